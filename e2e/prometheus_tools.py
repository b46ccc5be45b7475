"""Prometheus and promtool for the observability tests: Debian's `prometheus` package.

The tests run a real Prometheus against real processes and check the rule
file with promtool, so both must exist before pytest starts: `make test`
runs this module, which installs Debian's package (as root, the way CI and
the development machines run) when the binaries are missing.

    python -m e2e.prometheus_tools      # install if missing, print the two paths
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "prometheus"


class ToolsMissing(RuntimeError):
    """Prometheus or promtool is not installed and cannot be installed here."""


@dataclass(frozen=True)
class PrometheusTools:
    prometheus: Path
    promtool: Path


def find_tools() -> PrometheusTools | None:
    prometheus, promtool = shutil.which("prometheus"), shutil.which("promtool")
    if prometheus is None or promtool is None:
        return None
    return PrometheusTools(Path(prometheus), Path(promtool))


def _apt(*args: str) -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    proc = subprocess.run(["apt-get", *args], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        raise ToolsMissing(f"`apt-get {' '.join(args)}` failed:\n{tail}")


def ensure_tools() -> PrometheusTools:
    """The installed tools, installing Debian's package first when they are missing."""
    tools = find_tools()
    if tools is not None:
        return tools
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise ToolsMissing(
            "prometheus and promtool are needed by the observability tests: "
            f"`apt-get install {PACKAGE}` (as root)"
        )
    print(f"installing Debian's {PACKAGE} package (prometheus, promtool)...", file=sys.stderr)
    _apt("update", "-qq")
    # The package's service is not started: invoke-rc.d refuses without an init system.
    _apt("install", "-y", "-qq", "--no-install-recommends", PACKAGE)
    tools = find_tools()
    if tools is None:
        raise ToolsMissing(f"the {PACKAGE} package installed no prometheus/promtool on PATH")
    return tools


def main() -> int:
    try:
        tools = ensure_tools()
    except ToolsMissing as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(tools.prometheus)
    print(tools.promtool)
    return 0


if __name__ == "__main__":
    sys.exit(main())
