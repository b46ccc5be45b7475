"""The node agent's pure decisions: addresses, back-off, probes, pod status."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from e2e.nodeagent.backoff import (
    BackoffPolicy,
    compute_restart_delay,
    count_consecutive_crashes,
    should_restart,
)
from e2e.nodeagent.network import (
    NUM_HOSTS_PER_NODE,
    AddressesExhausted,
    PodAddressPool,
    node_address,
)
from e2e.nodeagent.probes import ProbeError, ProbeKind, ProbeTracker, parse_probe
from e2e.nodeagent.status import (
    ContainerView,
    PodView,
    Running,
    Terminated,
    Waiting,
    build_pod_status,
    compute_phase,
)

# ---------------------------------------------------------------- addresses


@given(st.lists(st.one_of(st.just("alloc"), st.integers(0, 300)), max_size=400))
def test_pod_addresses_are_never_handed_out_twice(operations: list[Any]) -> None:
    pool = PodAddressPool(block=7, node_index=3)
    in_use: list[str] = []
    for op in operations:
        if op == "alloc":
            if len(in_use) == NUM_HOSTS_PER_NODE:
                with pytest.raises(AddressesExhausted):
                    pool.allocate()
                continue
            address = pool.allocate()
            assert address not in in_use
            assert address.startswith("127.7.3.") and 1 <= int(address.split(".")[-1]) <= 254
            in_use.append(address)
        elif in_use:
            pool.release(in_use.pop(op % len(in_use)))
        assert pool.num_in_use == len(in_use)


def test_a_released_address_is_reused_last() -> None:
    pool = PodAddressPool(block=1, node_index=1)
    first = pool.allocate()
    pool.release(first)
    following = [pool.allocate() for _ in range(NUM_HOSTS_PER_NODE - 1)]
    assert first not in following
    assert pool.allocate() == first  # only once every other address was used


@pytest.mark.parametrize(
    ("address", "message"),
    [("127.1.2.5", "not a pod address of this node"), ("127.1.1.9", "not allocated")],
)
def test_releasing_a_foreign_address_is_refused_and_changes_nothing(
    address: str, message: str
) -> None:
    pool = PodAddressPool(block=1, node_index=1)
    kept = pool.allocate()
    with pytest.raises(ValueError, match=message):
        pool.release(address)
    assert pool.num_in_use == 1
    pool.release(kept)


@pytest.mark.parametrize(("block", "index"), [(0, 1), (254, 1), (1, 0), (1, 251)])
def test_out_of_range_blocks_and_nodes_are_refused(block: int, index: int) -> None:
    with pytest.raises(ValueError):
        node_address(block, index)


def test_node_addresses_live_in_their_block() -> None:
    assert node_address(12, 4) == "127.12.0.4"


# ---------------------------------------------------------------- back-off


@given(
    base=st.floats(0.01, 10),
    factor=st.floats(1, 100),
    crashes=st.integers(1, 10_000),
)
def test_restart_delay_doubles_up_to_its_cap(base: float, factor: float, crashes: int) -> None:
    policy = BackoffPolicy(base_s=base, max_s=base * factor)
    delay = compute_restart_delay(policy, crashes)
    assert base <= delay <= policy.max_s
    if crashes > 1:
        previous = compute_restart_delay(policy, crashes - 1)
        assert delay == min(previous * 2, policy.max_s) or delay == policy.max_s


def test_a_long_run_resets_the_crash_count() -> None:
    policy = BackoffPolicy(base_s=1, max_s=30, reset_after_s=60)
    assert count_consecutive_crashes(policy, previous=5, ran_for_s=1) == 6
    assert count_consecutive_crashes(policy, previous=5, ran_for_s=61) == 1


@pytest.mark.parametrize(
    ("policy", "exit_code", "expected"),
    [
        ("Always", 0, True),
        ("Always", 1, True),
        ("OnFailure", 0, False),
        ("OnFailure", 137, True),
        ("Never", 0, False),
        ("Never", 2, False),
    ],
)
def test_restart_policy_table(policy: str, exit_code: int, expected: bool) -> None:
    assert should_restart(policy, exit_code) is expected


def test_unknown_restart_policy_and_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="restartPolicy"):
        should_restart("Sometimes", 0)
    with pytest.raises(ValueError):
        BackoffPolicy(base_s=10, max_s=1)
    with pytest.raises(ValueError):
        compute_restart_delay(BackoffPolicy(), 0)


# ---------------------------------------------------------------- probes

CONTAINER = {"name": "c", "ports": [{"name": "http", "containerPort": 8080}]}


def test_probe_ports_resolve_by_name_or_number() -> None:
    named = parse_probe({"httpGet": {"port": "http", "path": "/ready"}}, CONTAINER, "readiness")
    assert (named.kind, named.port, named.path) == (ProbeKind.HTTP_GET, 8080, "/ready")
    assert parse_probe({"tcpSocket": {"port": 9}}, CONTAINER, "liveness").port == 9
    exec_probe = parse_probe({"exec": {"command": ["true"]}, "periodSeconds": 2}, CONTAINER, "x")
    assert (exec_probe.command, exec_probe.period_s) == (("true",), 2.0)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"httpGet": {"port": "metrics"}}, "no container port named 'metrics'"),
        ({"httpGet": {"port": 70000}}, "out of range"),
        ({"httpGet": {"port": 80, "scheme": "FTP"}}, "scheme"),
        ({"exec": {"command": []}}, "empty"),
        ({"grpc": {"port": 80}}, "only httpGet, tcpSocket and exec"),
        ({"tcpSocket": {"port": 80}, "failureThreshold": -1}, "thresholds"),
    ],
)
def test_bad_probes_are_refused_with_the_field_named(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ProbeError, match=message):
        parse_probe(raw, CONTAINER, "readiness")


@given(
    results=st.lists(st.booleans(), max_size=60),
    success_threshold=st.integers(1, 4),
    failure_threshold=st.integers(1, 4),
)
def test_probe_verdict_follows_consecutive_thresholds(
    results: list[bool], success_threshold: int, failure_threshold: int
) -> None:
    spec = parse_probe(
        {
            "tcpSocket": {"port": 1},
            "successThreshold": success_threshold,
            "failureThreshold": failure_threshold,
            "periodSeconds": 1,
        },
        CONTAINER,
        "p",
    )
    tracker = ProbeTracker(spec, started_at=0.0)
    verdict: bool | None = None
    run_value, run_length = None, 0
    for i, ok in enumerate(results):
        assert tracker.is_due(float(i))
        run_length = run_length + 1 if ok == run_value else 1
        run_value = ok
        if ok and run_length >= success_threshold:
            verdict = True
        if not ok and run_length >= failure_threshold:
            verdict = False
        assert tracker.record(ok, float(i)) is verdict
        assert not tracker.is_due(i + 0.5)


def test_no_probe_before_the_initial_delay() -> None:
    spec = parse_probe({"tcpSocket": {"port": 1}, "initialDelaySeconds": 5}, CONTAINER, "p")
    tracker = ProbeTracker(spec, started_at=100.0)
    assert not tracker.is_due(104.9) and tracker.is_due(105.0)


# ---------------------------------------------------------------- pod status

RUNNING = Running(started_at=1.0)
EXITED_0 = Terminated(0, "Completed", 1.0, 2.0)
EXITED_1 = Terminated(1, "Error", 1.0, 2.0)
CREATING = Waiting("ContainerCreating")
BACKOFF = Waiting("CrashLoopBackOff")


def view(
    policy: str, *containers: tuple[Any, Terminated | None], init: tuple[Any, ...] = ()
) -> PodView:
    return PodView(
        restart_policy=policy,
        host_ip="127.1.0.1",
        pod_ip="127.1.1.1",
        start_time=0.0,
        init_containers=tuple(ContainerView(f"i{n}", "img", s) for n, s in enumerate(init)),
        containers=tuple(
            ContainerView(f"c{n}", "img", state, last_state=last)
            for n, (state, last) in enumerate(containers)
        ),
    )


@pytest.mark.parametrize(
    ("pod", "phase"),
    [
        (view("Always", (CREATING, None)), "Pending"),
        (view("Always", (RUNNING, None), (CREATING, None)), "Pending"),
        (view("Always", (RUNNING, None)), "Running"),
        (view("Always", (BACKOFF, EXITED_1)), "Running"),  # restarting counts as stopped
        (view("Always", (EXITED_0, None)), "Running"),
        (view("OnFailure", (EXITED_0, None), (EXITED_0, None)), "Succeeded"),
        (view("OnFailure", (BACKOFF, EXITED_1)), "Running"),
        (view("Never", (EXITED_0, None)), "Succeeded"),
        (view("Never", (EXITED_0, None), (EXITED_1, None)), "Failed"),
        (view("Never", (RUNNING, None), (EXITED_1, None)), "Running"),
        (view("Always", (CREATING, None), init=(RUNNING,)), "Pending"),
        (view("Never", (CREATING, None), init=(EXITED_1,)), "Failed"),
        (view("Always", (CREATING, None), init=(EXITED_1,)), "Pending"),
        (view("Always", (RUNNING, None), init=(EXITED_0,)), "Running"),
    ],
)
def test_pod_phase_follows_the_kubelet(pod: PodView, phase: str) -> None:
    assert compute_phase(pod) == phase


def test_condition_transition_time_moves_only_when_the_status_changes() -> None:
    unready = view("Always", (RUNNING, None))
    ready = replace(unready, containers=(replace(unready.containers[0], ready=True),))

    def ready_condition(status: dict[str, Any]) -> dict[str, Any]:
        return next(c for c in status["conditions"] if c["type"] == "Ready")

    first, memory = build_pod_status(unready, {}, now=100.0)
    assert ready_condition(first)["status"] == "False"
    assert "containers with unready status: ['c0']" in ready_condition(first)["message"]
    again, memory = build_pod_status(unready, memory, now=200.0)
    assert (
        ready_condition(again)["lastTransitionTime"] == ready_condition(first)["lastTransitionTime"]
    )
    flipped, _ = build_pod_status(ready, memory, now=300.0)
    assert ready_condition(flipped)["status"] == "True"
    assert ready_condition(flipped)["lastTransitionTime"] == "1970-01-01T00:05:00Z"
    assert flipped["podIP"] == "127.1.1.1" and flipped["podIPs"] == [{"ip": "127.1.1.1"}]


def test_terminated_container_status_carries_exit_code_and_signal() -> None:
    killed = Terminated(137, "Error", 1.0, 2.0, signal=9)
    pod = view("Never", (killed, None))
    status, _ = build_pod_status(pod, {}, now=3.0)
    terminated = status["containerStatuses"][0]["state"]["terminated"]
    assert (terminated["exitCode"], terminated["signal"], terminated["reason"]) == (137, 9, "Error")
    assert status["phase"] == "Failed"
