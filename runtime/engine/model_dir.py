"""The folder a worker loads its model from, for every way the manifest names it.

- `model.name: tiny`: the built-in model, no folder ("tiny");
- `model.path`: that folder;
- `model.source` on Kubernetes: the operator mounts the source and says
  where through the environment (`MODEL_DIR_ENV` for pvc://, host:// and
  oci://; `HF_HUB_CACHE` for hf://, whose snapshot is found here);
- `model.source` in local mode (no such variable): `host://PATH` is the
  folder PATH itself, `hf://` is looked up in the local Hugging Face cache
  (`HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`);
  pvc:// and oci:// exist only where Kubernetes mounts them.

A Hugging Face cache holds `models--ORG--NAME/` with `refs/<branch or tag>`
(a file holding a commit hash) and `snapshots/<commit>/` (the repository's
files, usually links into `blobs/`). A revision that is a commit hash names
its snapshot directly; any other is read from `refs/`.

Whatever the source, the folder must hold `config.json`; otherwise
ModelDirError says which source and which path failed, and the worker
exits with that message (the pod's termination message; the operator
turns it into an Event naming the source).

I/O module: reads the file system.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from pdcluster.runtime.spec import ModelSourceKind, ModelSpec

# Set by the operator on pods whose model comes from a mounted source.
MODEL_DIR_ENV = "PDCLUSTER_MODEL_DIR"
HF_HUB_CACHE_ENV = "HF_HUB_CACHE"
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


class ModelDirError(RuntimeError):
    """The model cannot be read from its source; the message names the source and the path."""


def hf_cache_dir(env: Mapping[str, str]) -> Path:
    """The Hugging Face hub cache this process reads, as the hub's own library picks it."""
    if env.get(HF_HUB_CACHE_ENV):
        return Path(env[HF_HUB_CACHE_ENV])
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]) / "hub"
    return Path(env.get("HOME") or os.path.expanduser("~")) / ".cache" / "huggingface" / "hub"


def hf_snapshot_dir(cache: Path, repo: str, revision: str) -> Path:
    """The snapshot folder of `repo` at `revision` in the hub cache `cache`."""
    where = f"hf://{repo}@{revision} in the Hugging Face cache {cache}"
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    if not repo_dir.is_dir():
        raise ModelDirError(f"model source {where}: {repo_dir} does not exist (not downloaded)")
    commit = revision
    if not _COMMIT.match(revision):
        ref = repo_dir / "refs" / revision
        try:
            commit = ref.read_text().strip()
        except OSError as err:
            raise ModelDirError(
                f"model source {where}: cannot read {ref} ({err.strerror or err})"
            ) from None
        if not _COMMIT.match(commit):
            raise ModelDirError(f"model source {where}: {ref} holds no commit hash")
    snapshot = repo_dir / "snapshots" / commit
    if not snapshot.is_dir():
        raise ModelDirError(f"model source {where}: snapshot {snapshot} does not exist")
    return snapshot


def _checked(folder: Path, what: str) -> str:
    config = folder / "config.json"
    if not os.access(config, os.R_OK):
        reason = "is not readable" if config.exists() else "does not exist"
        raise ModelDirError(f"model source {what}: {config} {reason} (a model folder needs it)")
    return str(folder)


def resolve_model_dir(model: ModelSpec, env: Mapping[str, str]) -> str:
    """The folder to load (or "tiny"); ModelDirError when the source has no readable model."""
    if model.source is None:
        return "tiny" if model.name == "tiny" else str(model.path)
    source = model.source.parsed
    if source.kind is ModelSourceKind.hf:
        return _checked(
            hf_snapshot_dir(hf_cache_dir(env), source.repo, source.revision), source.uri
        )
    if env.get(MODEL_DIR_ENV):
        return _checked(Path(env[MODEL_DIR_ENV]), source.uri)
    if source.kind is ModelSourceKind.host:
        return _checked(Path(source.path), source.uri)
    raise ModelDirError(
        f"model source {source.uri}: a {source.kind.value}:// source is mounted by Kubernetes "
        f"(${MODEL_DIR_ENV} is not set here); outside Kubernetes use model.path or host://"
    )
