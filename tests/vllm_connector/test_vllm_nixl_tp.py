"""Real vLLM engines with our connector over NIXL, across tensor-parallel sizes (vLLM CPU TP).

Prefill TP1 → decode TP2: the decode runs two CPU workers (one KV head
each); each decode rank receives its head from the one prefill rank through
our head-splitting rules, the pages landing by one-sided NIXL WRITEs.
Prefill TP2 → decode TP1: each prefill rank writes its head into the one
decode rank's pages. The decode recomputes a prompt whose
KV never arrives (`kv_load_failure_policy: recompute`). The module ends with
the prefill killed (a restarted prefill serving again is test_vllm_tcp.py's
and test_vllm_local.py's).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from pdcluster.runtime.ports import free_ports
from tests.engine.testing import write_random_hf_dir
from tests.faults.harness import wait_until
from tests.vllm_connector.engines import connector, start_engines, stop_all
from tests.vllm_connector.pd_client import PDPair, prompts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

TRANSFER = {"backend": "nixl", "bootstrapTimeoutSeconds": 20}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    pytest.importorskip("nixl", reason="the nixl extra is not installed")
    root = tmp_path_factory.mktemp("vllm-nixl")
    model = write_random_hf_dir(
        root / "model", hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512
    )
    p_port, d_port, p2_port, d2_port = free_ports(4)
    engines = start_engines(
        {
            "prefill": {
                "model": str(model),
                "role": "kv_producer",
                "extra": connector("kv_producer", p_port, TRANSFER),
            },
            "decode": {
                "model": str(model),
                "role": "kv_consumer",
                "tp": 2,
                "failure_policy": "recompute",
                "extra": connector(
                    "kv_consumer", d_port, TRANSFER, prefillPeers=[f"127.0.0.1:{p_port}"]
                ),
            },
            "prefill-tp2": {
                "model": str(model),
                "role": "kv_producer",
                "tp": 2,
                "extra": connector("kv_producer", p2_port, TRANSFER),
            },
            "decode-tp1": {
                "model": str(model),
                "role": "kv_consumer",
                "extra": connector(
                    "kv_consumer", d2_port, TRANSFER, prefillPeers=[f"127.0.0.1:{p2_port}"]
                ),
            },
        },
        root,
    )
    state = {"engines": engines, "root": root}
    yield state
    stop_all(state["engines"].values())


@pytest.fixture
def pair(cluster: dict[str, Any]) -> PDPair:
    engines = cluster["engines"]
    return PDPair(engines["prefill"], engines["decode"])


def test_prefill_tp1_to_decode_tp2_over_nixl_equals_colocated(pair: PDPair) -> None:
    for prompt in prompts([5, 45, 300], seed=21):
        assert pair.pd(prompt, 10)["tokens"] == pair.colocated(prompt, 10)
    # Both decode ranks received their head of every prompt.
    info = pair.decode.side.get("/admin/failures").json()
    assert set(info["ranks"]) >= {"decode-tp0", "decode-tp1"}
    assert info["failures"] == {}
    pair.assert_clean()


def test_prefill_tp2_to_decode_tp1_over_nixl_equals_colocated(cluster: dict[str, Any]) -> None:
    engines = cluster["engines"]
    pair = PDPair(engines["prefill-tp2"], engines["decode-tp1"])
    for prompt in prompts([7, 45, 300], seed=23):
        assert pair.pd(prompt, 10)["tokens"] == pair.colocated(prompt, 10)
    # Both prefill ranks wrote their head of every prompt.
    info = pair.prefill.side.get("/admin/failures").json()
    assert set(info["ranks"]) >= {"prefill-tp0", "prefill-tp1"}
    assert info["failures"] == {}
    pair.assert_clean()


def test_a_lost_prefill_is_recomputed_by_the_decode(pair: PDPair, cluster: dict[str, Any]) -> None:
    """kill -9 of the prefill while the decode waits for a long prompt's KV: the
    supervisor's report fails the room at once, vLLM recomputes the prompt on the
    decode (the right answer, no leaked block)."""
    (prompt,) = prompts([1500], seed=22)
    want = pair.colocated(prompt, 6)
    room = pair.new_room()
    pair.decode.add("waits", prompt, 6, pair.params(room))
    wait_until(lambda: pair.decode_rooms(), 10, 0.05, "the decode's room to open")
    pair.prefill.kill()
    resp = pair.decode.side.post(
        "/admin/fail_peer",
        json={
            "peer": f"127.0.0.1:{pair.prefill.side_port}",
            "reason": "prefill_pod_lost",
            "gone": True,
        },
    )
    assert resp.status_code == 200
    # The room fails at the report, not at a timeout (then vLLM recomputes the
    # prompt); bench/vllm_connectors.py times it.
    wait_until(
        lambda: pair.decode_failures().get("room_failed:prefill_pod_lost"),
        10,
        0.02,
        "the decode to fail the room",
    )
    done = pair.decode.wait("done", 120, rid="waits")
    assert not done["error"] and done["tokens"] == want  # recomputed, token for token
    pair.assert_decode_clean()
