"""Pure parts of the transfer engine: headers, frame planning, checksums, jobs."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.transfer.checksum import compute_checksum, is_checksum_valid
from pdcluster.runtime.transfer.frames import (
    FRAME_VERSION,
    MAX_HEADER_BYTES,
    FrameError,
    KVFrameHeader,
    MiB,
    decode_header,
    encode_header,
    frame_nbytes,
    plan_frames,
    validate_header,
    validate_target,
)
from pdcluster.runtime.transfer.job import TransferJob, check_job
from tests.transfer.transfer_helpers import frame_header


@dataclass(frozen=True)
class Geometry:
    num_layers: int = 4
    num_pages: int = 16
    page_size: int = 4
    num_kv_heads: int = 4
    head_dim: int = 8
    dtype: str = "float16"


GEOM = Geometry()


def header(**kw: object) -> KVFrameHeader:
    base = frame_header(
        7, 1, layers=(1, 2), tokens=(4, 10), heads=(1, 3), head_dim=8, dtype="float16"
    )
    return msgspec.structs.replace(base, **kw)


# ---- headers -----------------------------------------------------------------


@given(
    room=st.integers(0, (1 << 63) - 1),
    generation=st.integers(0, 1 << 40),
    layers=st.lists(st.integers(0, 1000), min_size=1, max_size=64, unique=True),
    start=st.integers(0, 1 << 30),
    n=st.integers(1, 1 << 20),
    checksum=st.none() | st.integers(0, (1 << 32) - 1),
    is_last=st.booleans(),
)
def test_header_survives_the_wire(room, generation, layers, start, n, checksum, is_last):
    h = header(
        room=room,
        generation=generation,
        layers=tuple(layers),
        token_start=start,
        token_end=start + n,
        checksum=checksum,
        is_last=is_last,
    )
    assert decode_header(encode_header(h)) == h


@given(st.binary(max_size=512))
def test_garbage_header_is_rejected_not_crashing(data):
    try:
        decoded = decode_header(data)
    except FrameError as exc:
        assert exc.reason in {"bad_header", "bad_version"}
    else:  # random bytes that happen to be a valid header must round trip
        assert isinstance(decoded, KVFrameHeader)


def test_unknown_version_is_rejected_by_name():
    data = msgspec.msgpack.encode(msgspec.structs.replace(header(), version=FRAME_VERSION + 1))
    with pytest.raises(FrameError, match="bad_version"):
        decode_header(data)


def test_oversized_header_is_rejected_before_parsing():
    with pytest.raises(FrameError) as info:
        decode_header(b"\x00" * (MAX_HEADER_BYTES + 1))
    assert info.value.reason == "oversized"


def test_header_with_unknown_extra_fields_still_decodes():
    # A newer sender may add optional fields; an older receiver ignores them.
    raw = msgspec.msgpack.decode(encode_header(header()))
    raw["future_field"] = [1, 2, 3]
    assert decode_header(msgspec.msgpack.encode(raw)) == header()


def test_valid_header_passes_validation():
    h = header()
    validate_header(h, GEOM, frame_nbytes(h))
    assert frame_nbytes(h) == 2 * 2 * 6 * 2 * 8 * 2


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"dtype": "float32", "shape": (2, 2, 6, 2, 8)}, "dtype_mismatch"),
        ({"dtype": "int8"}, "dtype_mismatch"),
        ({"layers": ()}, "bad_layers"),
        ({"layers": (1, 1)}, "bad_layers"),
        ({"layers": (1, 4)}, "bad_layers"),
        ({"layers": (-1, 2)}, "bad_layers"),
        ({"head_start": 3, "head_end": 3}, "bad_heads"),
        ({"head_start": 2, "head_end": 5, "shape": (2, 2, 6, 3, 8)}, "bad_heads"),
        ({"head_start": -1, "head_end": 1}, "bad_heads"),
        ({"token_start": 10, "token_end": 10}, "bad_tokens"),
        ({"token_start": -2, "token_end": 4}, "bad_tokens"),
        ({"shape": (2, 2, 6, 2, 4)}, "bad_shape"),
        ({"shape": (2, 2, 5, 2, 8)}, "bad_shape"),
        ({"shape": (2, 6, 2, 8)}, "bad_shape"),
        ({"room": -5}, "bad_room"),
        ({"room": 1 << 63}, "bad_room"),
        ({"generation": -1}, "bad_header"),
    ],
)
def test_invalid_header_names_its_problem(change, reason):
    h = header(**change)
    with pytest.raises(FrameError) as info:
        validate_header(h, GEOM, frame_nbytes(header()))
    assert info.value.reason == reason


@pytest.mark.parametrize("delta", [-2, -1, 1, 4096])
def test_payload_size_must_match_the_header(delta):
    h = header()
    with pytest.raises(FrameError) as info:
        validate_header(h, GEOM, frame_nbytes(h) + delta)
    assert info.value.reason == "payload_size"


@pytest.mark.parametrize(
    ("num_table_pages", "ok"), [(3, True), (2, False), (0, False), (100, True)]
)
def test_target_must_cover_the_token_range(num_table_pages, ok):
    h = header(token_start=4, token_end=12, shape=(2, 2, 8, 2, 8))
    if ok:
        validate_target(h, num_table_pages, page_size=4)
    else:
        with pytest.raises(FrameError, match="out_of_bounds"):
            validate_target(h, num_table_pages, page_size=4)


# ---- planning ----------------------------------------------------------------


def plan_inputs(
    max_tokens: int, max_bytes_per_token: int, max_frame: int
) -> dict[str, st.SearchStrategy[Any]]:
    """`plan_frames` arguments up to these sizes (min_frame as a share of max_frame)."""
    return dict(
        num_tokens=st.integers(0, max_tokens),
        bytes_per_token=st.integers(1, max_bytes_per_token),
        max_frame=st.integers(1 << 10, max_frame),
        min_ratio=st.floats(0.001, 1.0),
        depth=st.integers(1, 8),
    )


def exact_cover_sizes(plan: list[tuple[int, int]], num_tokens: int) -> list[int]:
    """The frame sizes of a plan that covers [0, num_tokens) in order, without gap."""
    assert [s for s, _ in plan] == ([0] + [e for _, e in plan[:-1]] if plan else [])
    assert (plan[-1][1] if plan else 0) == num_tokens
    return [e - s for s, e in plan]


@given(**plan_inputs(200_000, 1 << 18, 64 * MiB))
def test_plan_covers_tokens_evenly_within_bounds(
    num_tokens, bytes_per_token, max_frame, min_ratio, depth
):
    min_frame = max(1, int(max_frame * min_ratio))
    if bytes_per_token > max_frame:
        with pytest.raises(ValueError, match="exceeds max_frame_bytes"):
            plan_frames(num_tokens, bytes_per_token, max_frame, min_frame, depth)
        return
    plan = plan_frames(num_tokens, bytes_per_token, max_frame, min_frame, depth)
    sizes = exact_cover_sizes(plan, num_tokens)
    assert all(size > 0 for size in sizes)
    assert all(size * bytes_per_token <= max_frame for size in sizes)
    if sizes:
        assert max(sizes) - min(sizes) <= 1
    fewest = math.ceil(num_tokens * bytes_per_token / max_frame)
    if len(plan) > 1:
        floor_bytes = min(min_frame, max_frame // 2) - bytes_per_token
        assert all(size * bytes_per_token >= floor_bytes for size in sizes)
        # Extra frames only for pipelining, never beyond the depth.
        assert len(plan) <= max(depth, math.ceil(num_tokens / (max_frame // bytes_per_token)))
    assert len(plan) >= min(fewest, num_tokens)


@given(
    **plan_inputs(50_000, 1 << 16, 16 * MiB),
    align=st.integers(1, 64),
    first_token=st.integers(0, 10_000),
)
def test_aligned_plan_cuts_only_at_block_boundaries(
    num_tokens, bytes_per_token, max_frame, min_ratio, depth, align, first_token
):
    if bytes_per_token > max_frame:
        return
    min_frame = max(1, int(max_frame * min_ratio))
    plan = plan_frames(
        num_tokens, bytes_per_token, max_frame, min_frame, depth,
        align_tokens=align, first_token=first_token,
    )  # fmt: skip
    sizes = exact_cover_sizes(plan, num_tokens)
    assert all(0 < size and size * bytes_per_token <= max_frame for size in sizes)
    max_tokens = max_frame // bytes_per_token
    if align <= max_tokens:
        # Every cut sits on a block boundary, so inner frames hold whole blocks.
        assert all((first_token + end) % align == 0 for _, end in plan[:-1])
        inner = sizes[1:-1]
        if inner:
            assert max(inner) - min(inner) <= align
        if len(plan) > 1:
            floor_bytes = min(min_frame, max_frame // 2) - 3 * align * bytes_per_token
            assert all(size * bytes_per_token >= floor_bytes for size in sizes)
    else:
        assert plan == plan_frames(num_tokens, bytes_per_token, max_frame, min_frame, depth)


@pytest.mark.parametrize(
    ("first_token", "num_tokens", "expected"),
    [
        (0, 128, [(0, 32), (32, 64), (64, 96), (96, 128)]),  # 16 MiB: whole pages
        (5, 128, [(0, 43), (43, 75), (75, 107), (107, 128)]),  # starts mid-page
        (0, 100, [(0, 32), (32, 64), (64, 96), (96, 100)]),  # ends mid-page
        (3, 8, [(0, 8)]),  # below the minimum: one frame
    ],
)
def test_aligned_plan_of_a_llama_sized_job(first_token, num_tokens, expected):
    bytes_per_token = 2 * 32 * 2 * 8 * 128  # 128 KiB, pages of 16 tokens
    plan = plan_frames(num_tokens, bytes_per_token, align_tokens=16, first_token=first_token)
    assert plan == expected
    assert all((first_token + end) % 16 == 0 for _, end in plan[:-1])


def test_plan_rejects_bad_alignment():
    with pytest.raises(ValueError, match="align_tokens"):
        plan_frames(10, 4, align_tokens=0)
    with pytest.raises(ValueError, match="first_token"):
        plan_frames(10, 4, first_token=-1)


@pytest.mark.parametrize(
    ("total", "expected_frames"),
    [
        (128 * 1024, 1),  # one token: one frame, below the 1 MiB minimum
        (1 * MiB, 1),
        (2 * MiB, 2),
        (16 * MiB, 4),  # split for overlap, 4 MiB each
        (256 * MiB, 16),  # 16 frames of 16 MiB
    ],
)
def test_default_plan_sizes(total, expected_frames):
    bytes_per_token = 2 * 32 * 2 * 8 * 128  # 32 layers, K+V, 8 heads, dim 128, fp16: 128 KiB
    plan = plan_frames(total // bytes_per_token, bytes_per_token)
    assert len(plan) == expected_frames
    assert {(e - s) * bytes_per_token for s, e in plan} == {total // expected_frames}


@pytest.mark.parametrize(
    "args",
    [(-1, 4), (10, 0), (10, 4, 100, 200), (10, 4, 100, 0), (10, 4, 100, 10, 0), (10, 200, 100)],
)
def test_plan_rejects_bad_arguments(args):
    with pytest.raises(ValueError):
        plan_frames(*args)


# ---- checksum ----------------------------------------------------------------


@given(st.binary(min_size=1, max_size=4096), st.data())
def test_checksum_catches_any_single_bit_flip(data, draw):
    crc = compute_checksum(data)
    assert is_checksum_valid(memoryview(data), crc)
    pos = draw.draw(st.integers(0, len(data) - 1))
    bit = draw.draw(st.integers(0, 7))
    flipped = bytearray(data)
    flipped[pos] ^= 1 << bit
    assert not is_checksum_valid(flipped, crc)


# ---- jobs --------------------------------------------------------------------

SRC = Geometry(num_layers=2, num_pages=8, page_size=4, num_kv_heads=8, dtype="float16")
DST = Geometry(num_layers=4, num_pages=8, page_size=4, num_kv_heads=4, dtype="float16")


def job(**kw: object) -> TransferJob:
    base = dict(
        room=3,
        generation=0,
        peer="tcp://127.0.0.1:5000",
        src_slots=[0, 1, 2, 5],
        token_start=0,
        token_end=4,
        src_layers=(0, 1),
        dst_layers=(2, 3),
        src_heads=(4, 8),
        dst_heads=(0, 4),
    )
    base.update(kw)
    return TransferJob(**base)  # type: ignore[arg-type]


def test_valid_job_passes_for_both_kinds_of_transport():
    check_job(job(), SRC)
    check_job(job(dst_slots=[9, 10, 11, 31]), SRC, DST)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"room": -1}, "room"),
        ({"generation": -1}, "generation"),
        ({"peer": "127.0.0.1:5000"}, "tcp://"),
        ({"token_start": 4}, "empty"),
        ({"src_slots": [0, 1, 2]}, "3 src_slots for 4 tokens"),
        ({"src_slots": [0, 1, 2, 32]}, "src_slots outside"),
        ({"src_slots": [0, 1, 1, 2]}, "repeats a slot"),
        ({"src_layers": (0, 2)}, "src_layers"),
        ({"src_layers": ()}, "src_layers is empty"),
        ({"dst_layers": (2,)}, "1 dst_layers"),
        ({"dst_layers": (-1, 0)}, "negative"),
        ({"src_heads": (4, 9)}, "exceeds"),
        ({"dst_heads": (0, 3)}, "differ in size"),
        ({"src_heads": (2, 2)}, "empty"),
    ],
)
def test_invalid_job_is_refused_with_a_reason(change, message):
    with pytest.raises(ValueError, match=message):
        check_job(job(**change), SRC)


@pytest.mark.parametrize(
    ("change", "dst", "message"),
    [
        ({}, DST, "needs dst_slots"),
        ({"dst_slots": [0, 1]}, DST, "2 dst_slots"),
        ({"dst_slots": [0, 1, 2, 32]}, DST, "dst_slots outside"),
        ({"dst_slots": [0, 1, 2, 3], "dst_layers": (3, 4)}, DST, "outside 0..3"),
        ({"dst_slots": [0, 1, 2, 3]}, replace(DST, dtype="float32"), "dtype"),
        ({"dst_slots": [0, 1, 2, 3]}, replace(DST, head_dim=16), "head_dim"),
        ({"dst_slots": [0, 1, 2, 3], "dst_heads": (2, 6)}, DST, "exceeds"),
    ],
)
def test_one_sided_job_is_checked_against_the_destination(change, dst, message):
    with pytest.raises(ValueError, match=message):
        check_job(job(**change), SRC, dst)
