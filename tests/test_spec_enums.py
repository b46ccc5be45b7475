"""The spec's shared vocabulary: roles, backends, KV dtypes and their sizes, page arithmetic."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.spec import (
    KVDtype,
    PDClusterSpec,
    Role,
    SpecError,
    TransferBackend,
    pages_for,
    parse_spec,
)


@pytest.mark.parametrize("dtype", list(KVDtype))
def test_kv_dtype_itemsize_is_what_torch_stores(dtype: KVDtype) -> None:
    assert dtype.itemsize == torch.empty(0, dtype=getattr(torch, dtype.value)).element_size()
    assert KVDtype.itemsize_of(dtype.value) == dtype.itemsize


@pytest.mark.parametrize("name", ["int8", "", "FLOAT32", "float"])
def test_an_unknown_dtype_name_has_no_itemsize(name: str) -> None:
    assert KVDtype.itemsize_of(name) is None


@pytest.mark.parametrize(
    ("tokens", "page_size", "pages"), [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (9, 1, 9)]
)
def test_pages_for(tokens: int, page_size: int, pages: int) -> None:
    assert pages_for(tokens, page_size) == pages


@given(st.integers(0, 1 << 20), st.integers(1, 1024))
def test_pages_for_is_the_fewest_pages_that_hold_the_tokens(tokens: int, page_size: int) -> None:
    pages = pages_for(tokens, page_size)
    assert pages * page_size >= tokens
    assert pages == 0 or (pages - 1) * page_size < tokens


@pytest.mark.parametrize(("tokens", "page_size"), [(-1, 4), (4, 0), (4, -2)])
def test_pages_for_rejects_impossible_arithmetic(tokens: int, page_size: int) -> None:
    with pytest.raises(ValueError, match="pages_for needs num_tokens >= 0 and page_size >= 1"):
        pages_for(tokens, page_size)


@pytest.mark.parametrize("name", ["prefill", "decode", "colocated"])
def test_a_role_parses_from_and_serializes_to_its_name(name: str) -> None:
    role = Role.parse(name)
    assert role is Role(name)
    assert str(role) == name and f"{role}" == name


@pytest.mark.parametrize("value", ["router", "Prefill", "", None, 1])
def test_a_bad_role_is_refused_naming_the_roles(value: object) -> None:
    with pytest.raises(SpecError, match="expected one of prefill, decode, colocated") as err:
        Role.parse(value)
    assert repr(value) in str(err.value)


def test_every_role_names_its_spec_field() -> None:
    pd = parse_spec({"prefill": {"replicas": 2}, "decode": {"replicas": 3}})
    assert pd.role_spec(Role.prefill) is pd.prefill and pd.prefill is not None
    assert pd.role_spec(Role.decode) is pd.decode and pd.decode is not None
    assert pd.role_spec(Role.colocated) is None
    colocated = parse_spec({"colocated": {}})
    assert colocated.role_spec(Role.colocated) is colocated.colocated
    assert {r.value for r in Role} <= set(PDClusterSpec.model_fields)


def test_shm_and_nixl_write_one_sided() -> None:
    assert [b for b in TransferBackend if b.is_one_sided] == [
        TransferBackend.shm,
        TransferBackend.nixl,
    ]
