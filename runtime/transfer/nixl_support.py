"""Whether the `nixl` backend can run here, and the UCX settings it runs with.

`nixl` is an optional extra (`pip install 'pdcluster[nixl]'`): a manifest
asking for `transfer.backend: nixl` on a machine without it is refused at
start-up with the install hint, not at the first transfer.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from collections.abc import MutableMapping

from pdcluster.runtime.spec import PDClusterSpec, SpecError, TransferBackend, UcxSpec

INSTALL_HINT = "install it with `pip install 'pdcluster[nixl]'` (PyPI package nixl==1.5.1)"


def nixl_import_error() -> str | None:
    """None if the NIXL Python API imports, else why not."""
    try:
        importlib.import_module("nixl._api")
    except Exception as err:  # ImportError, or a bundled library that fails to load
        return f"{type(err).__name__}: {err}"
    return None


def check_backend_available(spec: PDClusterSpec) -> None:
    """Raise SpecError naming the install hint if the spec needs NIXL and it is missing."""
    if spec.transfer.backend is not TransferBackend.nixl:
        return
    problem = nixl_import_error()
    if problem is not None:
        raise SpecError(
            f"spec.transfer.backend: nixl needs the `nixl` package, which does not import "
            f"here ({problem}); {INSTALL_HINT}"
        )


def apply_ucx_env(
    ucx: UcxSpec, env: MutableMapping[str, str] | None = None, log_dir: str | None = None
) -> None:
    """Set UCX_TLS / UCX_NET_DEVICES from the manifest (before any NIXL agent exists).

    Unless the operator of the box set its own UCX_LOG_LEVEL, UCX also logs
    at info level into `log_dir/ucx-<pid>.log` (the temp dir by default):
    those lines name the transports UCX selected (`ucx_report`).
    """
    target = os.environ if env is None else env
    if ucx.tls is not None:
        target["UCX_TLS"] = ucx.tls
    if ucx.net_devices is not None:
        target["UCX_NET_DEVICES"] = ucx.net_devices
    if "UCX_LOG_LEVEL" not in target:
        target["UCX_LOG_LEVEL"] = "info"
        target["UCX_LOG_FILE"] = os.path.join(log_dir or tempfile.gettempdir(), "ucx-%p.log")


def ucx_log_path(env: MutableMapping[str, str] | None = None) -> str | None:
    """This process's UCX log file, if UCX logs to one."""
    pattern = (os.environ if env is None else env).get("UCX_LOG_FILE")
    return pattern.replace("%p", str(os.getpid())) if pattern else None
