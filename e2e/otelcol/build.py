"""Builds the pinned OpenTelemetry Collector the tracing tests receive spans with.

The Go module next to this file (go.mod, go.sum, cmd/pdc-otelcol) is the pin:
the collector's OTLP receiver and the contrib file exporter, nothing else.
Like the control plane (`e2e/controlplane/build.py`, whose cache, lock and Go
environment this reuses), the binary is built once per pin into the cache
and renamed into place only when complete.

    python -m e2e.otelcol.build     # build if missing, print the binary's path
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import time
from pathlib import Path

from e2e.controlplane.build import (
    BuildError,
    _locked,
    default_cache_root,
    find_go,
    go_environment,
)

COLLECTOR_VERSION = "v0.161.0"
BINARY = "pdc-otelcol"
MODULE_DIR = Path(__file__).resolve().parent
PIN_FILES = ("go.mod", "go.sum", f"cmd/{BINARY}/main.go")


def compute_cache_key(pinned: dict[str, bytes], go_version: str) -> str:
    """A hash of everything that changes the binary."""
    digest = hashlib.sha256(go_version.encode())
    for name in sorted(pinned):
        digest.update(b"\0" + name.encode() + b"\0" + hashlib.sha256(pinned[name]).digest())
    return digest.hexdigest()[:16]


def _go(args: list[str], env: dict[str, str]) -> str:
    proc = subprocess.run(
        [find_go(), *args], cwd=MODULE_DIR, env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise BuildError(f"`go {' '.join(args[:2])} ...` failed (exit {proc.returncode}):\n{tail}")
    return proc.stdout


def ensure_collector(cache_root: Path | None = None) -> Path:
    """The collector binary of this pin, built first if the cache has none."""
    root = cache_root or default_cache_root()
    env = go_environment(root)
    pinned = {name: (MODULE_DIR / name).read_bytes() for name in PIN_FILES}
    key = compute_cache_key(pinned, _go(["env", "GOVERSION"], env).strip())
    binary = root / f"otelcol-{COLLECTOR_VERSION}-{key}" / BINARY
    if binary.is_file():
        return binary
    with _locked(root / ".otelcol.lock"):
        if binary.is_file():
            return binary
        scratch = binary.with_name(BINARY + ".partial")
        scratch.parent.mkdir(parents=True, exist_ok=True)
        print(f"building the OpenTelemetry Collector {COLLECTOR_VERSION}...", file=sys.stderr)
        started = time.monotonic()
        _go(["build", "-ldflags", "-s -w", "-o", str(scratch), f"./cmd/{BINARY}"], env)
        shutil.move(scratch, binary)
        print(f"collector built in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return binary


def main() -> int:
    try:
        print(ensure_collector())
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
