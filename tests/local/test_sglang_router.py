"""The SGLang router command line shared by the interop test and bench/router.py."""

from __future__ import annotations

import sys

from pdcluster.runtime.local.sglang_router import sglang_router_argv


def _values(argv: list[str], flag: str) -> list[list[str]]:
    """The words after each `flag`, up to the next flag."""
    out = []
    for i, word in enumerate(argv):
        if word == flag:
            rest = argv[i + 1 :]
            end = next((j for j, w in enumerate(rest) if w.startswith("--")), len(rest))
            out.append(rest[:end])
    return out


def test_every_prefill_carries_its_bootstrap_port_and_every_decode_its_url() -> None:
    argv = sglang_router_argv(
        [("http://127.0.0.1:1001", 1003), ("http://127.0.0.1:2001", 2003)],
        ["http://127.0.0.1:3001"],
        port=4000,
        prometheus_port=4001,
        api_key="secret",
    )
    assert argv[:4] == [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    assert _values(argv, "--prefill") == [
        ["http://127.0.0.1:1001", "1003"],
        ["http://127.0.0.1:2001", "2003"],
    ]
    assert _values(argv, "--decode") == [["http://127.0.0.1:3001"]]
    assert _values(argv, "--port") == [["4000"]]
    assert _values(argv, "--prometheus-port") == [["4001"]]
    assert _values(argv, "--api-key") == [["secret"]]
    # A failure must reach the client as it happened, not retried elsewhere.
    assert "--disable-retries" in argv
