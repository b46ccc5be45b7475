"""A decode rank's NIXL progress thread: asleep while idle, woken by UCX events.

NIXL's Python API creates its agents with a progress-thread delay of 0, which
makes the thread's poll() return at once: it spins a core for the agent's
whole life. Ours are created with `PROGRESS_WAKE_US` (`nixl_agent.py`).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.transfer.nixl_helpers import need_nixl
from tests.transfer.transfer_helpers import (
    Link,
    bits,
    expected_pool,
    make_shape,
    random_pool,
    random_table,
    send_one_job,
    whole_job,
)

# An agent that lives this long, idle, in a process of its own (seconds).
IDLE_S = 1.0
# CPU seconds its process may spend over that time: a spinning thread spends about
# IDLE_S, a sleeping one a few hundredths.
IDLE_CPU_BUDGET_S = 0.25

IDLE_AGENT = """
import json, os, sys, time
from pdcluster.runtime.engine.kv_pool import KVPool, KVPoolShape
from pdcluster.runtime.transfer.nixl_agent import NixlAgent
pool = KVPool(KVPoolShape(2, 8, 16, 2, 64, "float32"), device="cpu")
agent = NixlAgent("idle", pool)  # a decode rank's: with NIXL's progress thread
time.sleep(0.2)  # the thread is running
t0 = os.times()
time.sleep(float(sys.argv[1]))
t1 = os.times()
print(json.dumps({"cpu_s": (t1.user - t0.user) + (t1.system - t0.system)}))
"""


@pytest.fixture(autouse=True)
def _nixl() -> None:
    need_nixl()


def test_an_idle_agents_progress_thread_sleeps():
    out = subprocess.run(
        [sys.executable, "-c", IDLE_AGENT, str(IDLE_S)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    cpu_s = json.loads(out.stdout.strip().splitlines()[-1])["cpu_s"]
    assert cpu_s < IDLE_CPU_BUDGET_S, f"an idle agent spent {cpu_s:.2f} CPU-s in {IDLE_S} s"


def test_the_config_keeps_our_delay_whatever_the_api_sets():
    from nixl import _api

    from pdcluster.runtime.transfer.nixl_agent import _agent_config_with_wake

    base = _api.nixlBind.nixlAgentConfig
    with _agent_config_with_wake(1234):
        config = _api.nixlBind.nixlAgentConfig()
        config.pthrDelay = 0  # what NIXL's API sets
        config.useProgThread = True
        assert config.pthrDelay == 1234 and config.useProgThread is True
    assert _api.nixlBind.nixlAgentConfig is base  # put back after the call


def test_a_write_over_ucx_tcp_completes_with_the_sleeping_thread(monkeypatch):
    """Over UCX's tcp lanes a WRITE is messages the target's worker must handle: the
    decode agent's thread, asleep in poll(), is woken by them (a 30 s handle timeout
    and a notification wait of 10 s bound a thread that would not wake)."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    from pdcluster.runtime.transfer.nixl import NixlTransport
    from pdcluster.runtime.transfer.nixl_agent import NixlAgent

    link = Link.open()
    shape = make_shape(num_pages=64)
    src, dst = random_pool(shape, 50), random_pool(shape, 51)
    t = NixlTransport(link.prefill, NixlAgent("tcp-prefill", src, progress_thread=False))
    decode_agent = NixlAgent("tcp-decode", dst)
    try:
        t.register_peer(link.decode.address, decode_agent.region(), dst.shape)
        job = whole_job(
            random_table(16, 64, 52), random_table(16, 64, 53), link.decode.address, "nixl",
            tokens=(0, 60),
        )  # fmt: skip
        want = expected_pool(
            src, dst, job.src_slots, job.dst_slots, (0, 1, 2), (0, 1, 2), (0, 4), (0, 4)
        )
        completed = send_one_job(link, src, t, job, drain_s=10)
        assert completed == [job]
        assert torch.equal(bits(dst.buffer), bits(want))
    finally:
        t.close()
        decode_agent.close()
        link.close()
