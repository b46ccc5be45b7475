"""Shared by the tests that run the `nixl` backend: it must be installed (an extra)."""

from __future__ import annotations

from tests.operator.helpers import unavailable

MISSING_NIXL = "needs the `nixl` package: `make setup` installs it (extra `nixl`)"


def need_nixl() -> None:
    """Skip without NIXL, except under CI=true, where a missing extra fails the test."""
    from pdcluster.runtime.transfer.nixl_support import nixl_import_error

    problem = nixl_import_error()
    if problem is not None:
        unavailable(f"{MISSING_NIXL} ({problem})")
