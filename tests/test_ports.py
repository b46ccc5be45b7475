"""Ports picked for later binds come from below the kernel's ephemeral range."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from pdcluster.runtime import ports


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    top = ports.ephemeral_start()
    got = ports.free_ports(20)
    assert len(set(got)) == 20
    assert all(ports.LOWEST <= p < top for p in got), got
    for p in got:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", p))


class _Scripted(random.Random):
    """Draws the given ports in order (then defers to a real generator)."""

    def __init__(self, draws: list[int]) -> None:
        super().__init__(0)
        self.draws = list(draws)

    def randrange(self, *args: int) -> int:  # type: ignore[override]
        return self.draws.pop(0) if self.draws else super().randrange(*args)


def test_a_port_something_listens_on_or_already_picked_is_skipped() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        taken = busy.getsockname()[1]
        first = ports.free_port()
        got = ports.free_ports(2, rng=_Scripted([taken, first, first]))
    assert taken not in got
    assert got[0] == first and got[1] != first


def test_the_ephemeral_range_is_read_from_the_kernel_file(tmp_path: Path) -> None:
    rf = tmp_path / "range"
    rf.write_text("40000\t60999\n")
    assert ports.ephemeral_start(rf) == 40000
    rf.write_text("garbage")
    assert ports.ephemeral_start(rf) == ports.DEFAULT_EPHEMERAL_START
    assert ports.ephemeral_start(tmp_path / "missing") == ports.DEFAULT_EPHEMERAL_START


def test_no_room_below_the_ephemeral_range_falls_back_to_kernel_ports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ports, "ephemeral_start", lambda: ports.LOWEST + 2)
    got = ports.free_ports(3)
    assert len(set(got)) == 3
    assert all(p >= ports.LOWEST + 2 for p in got), got


def test_an_exhausted_range_is_an_error_not_a_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_bindable", lambda host, port: False)
    with pytest.raises(OSError, match="no 2 free ports"):
        ports.free_ports(2)
