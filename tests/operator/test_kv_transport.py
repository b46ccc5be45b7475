"""The negotiated KV transport in the PDCluster status, and the Warning on a fallback to TCP.

Pure decisions (`reconcile/kv_transport.py`) exhaustively; then the glue: a
controller pass writes the entry and the Event, and the failover poller
reads real HTTP workers' `/get_server_info`.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pdcluster.operator.api import KVTransportStatus
from pdcluster.operator.reconcile.kv_transport import (
    TransportReport,
    TransportTable,
    compute_kv_transport,
    is_rdma_requested,
    parse_transport_report,
    rdma_request,
)
from pdcluster.runtime.ports import free_port
from pdcluster.runtime.spec import Role, TransferSpec, UcxSpec

from .podmaker import worker_pod
from .served import serving
from .test_controller import KEY, make, reasons
from .test_failover_io import TOKEN, make_failover

TCP_LANES = {"rma_am": ["tcp/lo"], "am": ["cma/memory", "tcp/lo"]}
RDMA_LANES = {"rma": ["rc_mlx5/mlx5_0:1"], "am": ["rc_mlx5/mlx5_0:1", "tcp/eth0"]}


def info(backend: str = "nixl", lanes: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """A `/get_server_info` answer as the workers write it (pd_worker/agent.py)."""
    report: dict[str, Any] = {"backend": backend}
    if backend == "nixl":
        report.update(ucx_lanes=lanes or {}, ucx_transports=[], tcp_fallback=False)
    return {"disaggregation_mode": "prefill", "kv_transport": report}


def report(backend: str = "nixl", lanes: dict[str, list[str]] | None = None) -> TransportReport:
    parsed = parse_transport_report(info(backend, lanes))
    assert parsed is not None
    return parsed


def transfer(backend: str = "nixl", **ucx: Any) -> TransferSpec:
    return TransferSpec(backend=backend, ucx=UcxSpec(**ucx))


# ---------------------------------------------------------------- what the manifest asks
@pytest.mark.parametrize(
    ("ucx", "why"),
    [
        ({}, None),
        ({"require_rdma": True}, "requireRdma"),
        ({"tls": "tcp,cma"}, None),
        ({"tls": "rc,cuda_ipc,cuda_copy"}, "tls names rc,cuda_ipc"),
        ({"tls": "rc_x"}, "tls names rc_x"),
        ({"tls": "tcp,dc_mlx5"}, "tls names dc_mlx5"),
        ({"tls": "cuda"}, "tls names cuda"),
        ({"tls": "ib:aux,tcp"}, "tls names ib"),
        # An exclusion list asks for everything but these: no RDMA asked for by name.
        ({"tls": "^tcp"}, None),
        ({"tls": "^rc"}, None),
        ({"tls": "^tcp", "require_rdma": True}, "requireRdma"),
    ],
)
def test_the_manifest_asks_for_rdma_by_flag_or_by_naming_an_rdma_transport(ucx, why) -> None:
    assert rdma_request(UcxSpec(**ucx)) == why
    assert is_rdma_requested(transfer("nixl", **ucx)) is (why is not None)
    # UCX settings mean nothing to the other backends.
    assert not is_rdma_requested(transfer("tcp", **ucx))
    assert not is_rdma_requested(transfer("shm", **ucx))


# ---------------------------------------------------------------- reading a worker's answer
def test_a_workers_report_gives_its_transports_devices_and_whether_it_fell_back() -> None:
    tcp = report(lanes=TCP_LANES)
    assert tcp.transports == ["cma", "tcp"]
    assert tcp.devices == ["cma/memory", "tcp/lo"]
    assert tcp.is_tcp_fallback
    rdma = report(lanes=RDMA_LANES)
    assert rdma.transports == ["rc_mlx5", "tcp"] and not rdma.is_tcp_fallback
    # No lane yet (no peer reached): no evidence of a fallback.
    assert not report(lanes={}).is_tcp_fallback
    assert report("tcp") == TransportReport("tcp", {})


@pytest.mark.parametrize(
    "answer",
    [
        None,
        [],
        "nixl",
        {},
        {"kv_transport": None},
        {"kv_transport": {}},
        {"kv_transport": {"backend": 3}},
        {"kv_transport": {"backend": ""}},
        {"kv_transport": {"backend": "nixl", "ucx_lanes": []}},
        {"kv_transport": {"backend": "nixl", "ucx_lanes": {"am": "tcp/lo"}}},
        {"kv_transport": {"backend": "nixl", "ucx_lanes": {"am": [1]}}},
        {"kv_transport": {"backend": "nixl", "ucx_lanes": {"am": ["x" * 129]}}},
        {"kv_transport": {"backend": "nixl", "ucx_lanes": {"am": ["tcp/lo"] * 65}}},
        {"kv_transport": {"backend": "nixl", "ucx_lanes": {f"l{i}": [] for i in range(65)}}},
    ],
)
def test_a_malformed_or_oversized_answer_is_no_report(answer) -> None:
    assert parse_transport_report(answer) is None


# ---------------------------------------------------------------- the status entry and the Event
SPECS = {
    "plain": transfer("nixl"),
    "require": transfer("nixl", require_rdma=True),
    "tls": transfer("nixl", tls="rc,cuda_ipc"),
    "tcp-backend": transfer("tcp", require_rdma=True),
}
REPORTS = {
    "none": [],
    "no-lanes": [report(lanes={})],
    "tcp": [report(lanes=TCP_LANES)],
    "rdma": [report(lanes=RDMA_LANES)],
    "mixed": [report(lanes=RDMA_LANES), report(lanes=TCP_LANES)],
    "tcp-backend": [report("tcp")],
}
PREVS: dict[str, KVTransportStatus | None] = {
    "absent": None,
    "fine": KVTransportStatus(backend="nixl", ucx_transports=["rc_mlx5"], reported=1),
    "missing": KVTransportStatus(
        backend="nixl", ucx_transports=["tcp"], tcp_fallback=True, rdma_requested=True, reported=1
    ),
    "fallback-unasked": KVTransportStatus(
        backend="nixl", ucx_transports=["tcp"], tcp_fallback=True, reported=1
    ),
}


@pytest.mark.parametrize(
    ("spec", "reports", "prev"), list(itertools.product(SPECS, REPORTS, PREVS))
)
def test_every_spec_report_and_stored_entry_gives_the_documented_entry_and_event(
    spec: str, reports: str, prev: str
) -> None:
    t, rs, before = SPECS[spec], REPORTS[reports], PREVS[prev]
    verdict = compute_kv_transport(Role.prefill, t, rs, before)
    requested = spec in ("require", "tls")
    if not rs:
        # Nobody answered: the stored entry stays, following only the spec; no Event.
        if before is None:
            assert verdict.status is None
        else:
            assert verdict.status == before.model_copy(update={"rdma_requested": requested})
        assert verdict.warning is None
        return
    status = verdict.status
    assert status is not None
    assert status.reported == len(rs)
    assert status.rdma_requested is requested
    assert status.backend == ("tcp" if reports == "tcp-backend" else "nixl")
    assert status.ucx_transports == sorted({x for r in rs for x in r.transports})
    assert status.ucx_devices == sorted({d for r in rs for d in r.devices})
    # One pod that fell back is a fallback of the role.
    assert status.tcp_fallback is (reports in ("tcp", "mixed"))
    missing = requested and reports in ("tcp", "mixed")
    already_warned = before is not None and before.is_rdma_missing
    assert (verdict.warning is not None) is (missing and not already_warned)
    if verdict.warning is not None:
        assert verdict.warning.startswith("prefill: the manifest asks for RDMA")
        assert "tcp/lo" in verdict.warning
        assert ("requireRdma" if spec == "require" else "tls names rc,cuda_ipc") in verdict.warning


def test_the_warning_message_is_stable_so_repeats_aggregate() -> None:
    t = SPECS["require"]
    first = compute_kv_transport(Role.decode, t, REPORTS["tcp"], None).warning
    again = compute_kv_transport(Role.decode, t, REPORTS["tcp"] * 2, None).warning
    assert first == again and first is not None and first.startswith("decode: ")


def test_a_fallback_cured_then_back_warns_again() -> None:
    t = SPECS["require"]
    fell = compute_kv_transport(Role.prefill, t, REPORTS["tcp"], None)
    assert fell.warning is not None
    cured = compute_kv_transport(Role.prefill, t, REPORTS["rdma"], fell.status)
    assert cured.warning is None and cured.status is not None and not cured.status.tcp_fallback
    again = compute_kv_transport(Role.prefill, t, REPORTS["tcp"], cured.status)
    assert again.warning == fell.warning


# ---------------------------------------------------------------- the table of reports
def test_the_table_keeps_a_silent_pods_last_report_and_forgets_gone_pods() -> None:
    table, key, other = TransportTable(), ("ns", "a"), ("ns", "b")
    tcp, rdma = report(lanes=TCP_LANES), report(lanes=RDMA_LANES)
    assert table.update(key, {"p1": (Role.prefill, tcp), "d1": (Role.decode, None)})
    assert table.reports(key) == {Role.prefill: [tcp]}
    # The same answers again: no change. A silent pod keeps its last report.
    assert not table.update(key, {"p1": (Role.prefill, None)})
    assert table.update(key, {"p1": (Role.prefill, rdma), "d1": (Role.decode, tcp)})
    assert table.reports(key) == {Role.prefill: [rdma], Role.decode: [tcp]}
    table.update(other, {"p9": (Role.prefill, tcp)})
    table.retain({"d1", "p9"})
    assert table.reports(key) == {Role.decode: [tcp]}
    table.forget(key)
    assert table.reports(key) == {} and table.reports(other) == {Role.prefill: [tcp]}


# ---------------------------------------------------------------- controller pass (glue)
NIXL_RDMA = {
    "transfer": {"backend": "nixl", "ucx": {"requireRdma": True}},
    "prefill": {},
    "decode": {},
}


async def test_a_pass_writes_each_roles_transport_and_warns_once_for_a_fallback() -> None:
    api, controller, clock = make(NIXL_RDMA)
    reports: dict[Role, list[TransportReport]] = {}
    controller.transport_reports = lambda key: reports if key == KEY else {}
    await controller.reconcile(KEY)
    status = api.store.objects[("PDCluster", "demo")]["status"]
    assert "kvTransport" not in status["prefill"]  # nobody reported yet
    reports[Role.prefill] = [report(lanes=TCP_LANES)]
    reports[Role.decode] = [report(lanes={})]
    clock.now += 1
    await controller.reconcile(KEY)
    status = api.store.objects[("PDCluster", "demo")]["status"]
    assert status["prefill"]["kvTransport"] == {
        "backend": "nixl",
        "ucxTransports": ["cma", "tcp"],
        "ucxDevices": ["cma/memory", "tcp/lo"],
        "tcpFallback": True,
        "rdmaRequested": True,
        "reported": 1,
    }
    assert status["decode"]["kvTransport"]["tcpFallback"] is False
    assert reasons(api)["KVTransportFallback"] == 1
    (event,) = [e for e in api.events() if e["reason"] == "KVTransportFallback"]
    assert event["type"] == "Warning" and event["message"].startswith("prefill: ")
    # Later passes, and a pass with no report at all (an operator restart), warn no more.
    writes = len(api.store.status_writes)
    for now_reports in (dict(reports), {}):
        reports.clear()
        reports.update(now_reports)
        clock.now += 60
        await controller.reconcile(KEY)
    assert reasons(api)["KVTransportFallback"] == 1
    assert len(api.store.status_writes) == writes
    kept = api.store.objects[("PDCluster", "demo")]["status"]["prefill"]["kvTransport"]
    assert kept["tcpFallback"] is True


async def test_a_tcp_cluster_shows_its_backend_and_never_warns() -> None:
    tcp = {**NIXL_RDMA, "transfer": {"backend": "tcp", "ucx": {"requireRdma": True}}}
    api, controller, _ = make(tcp)
    controller.transport_reports = lambda _: {Role.prefill: [report("tcp")]}
    await controller.reconcile(KEY)
    entry = api.store.objects[("PDCluster", "demo")]["status"]["prefill"]["kvTransport"]
    assert entry["backend"] == "tcp" and entry["rdmaRequested"] is False
    assert "KVTransportFallback" not in reasons(api)


# ---------------------------------------------------------------- the poller (real HTTP)
def info_app(answers: dict[str, Any]) -> FastAPI:
    app = FastAPI()

    @app.get("/get_server_info")
    async def server_info(request: Request) -> JSONResponse:
        if request.headers.get("authorization") != f"Bearer {TOKEN}":
            return JSONResponse({"error": {"message": "wrong token"}}, 403)
        return JSONResponse(answers["now"])

    return app


async def test_the_poller_reads_server_info_with_the_token_and_queues_a_reconcile_on_change():
    _, failover, _ = make_failover()
    queued: list[tuple[str, str]] = []
    failover.on_transport_change = queued.append
    answers: dict[str, Any] = {"now": info(lanes={})}
    port = free_port()
    async with serving((info_app(answers), port)):
        pod = worker_pod(Role.prefill, ip="127.0.0.1", http_port=port)
        await failover.on_pod_event("ADDED", pod)
        key = (pod["metadata"]["namespace"], pod["metadata"]["labels"]["pdcluster.io/cluster"])
        assert await failover.poll_transports(key)
        assert failover.transports.reports(key) == {Role.prefill: [report(lanes={})]}
        assert not await failover.poll_transports(key)  # nothing new: no reconcile
        answers["now"] = info(lanes=TCP_LANES)
        assert await failover.poll_transports(key)
        answers["now"] = {"garbage": True}  # a bad answer keeps the last good report
        assert not await failover.poll_transports(key)
        assert failover.transports.reports(key) == {Role.prefill: [report(lanes=TCP_LANES)]}
    assert queued == [key, key]
    await failover.aclose()
