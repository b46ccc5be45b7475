"""`pdcluster fetch-model hf://ORG/NAME[@REVISION] --cache DIR`: download a
Hugging Face model into a hub cache once, then check the worker can load it.

The operator runs this as the init container of every worker pod whose
`model.source` is `hf://` (the cache is the source's `cacheClaim`). The hub
library skips files already in the cache, so only the first pod of a
cluster downloads; the others find the snapshot and start at once. The
token, when the source names a Secret, is read from the file that Secret
is mounted as (never from the environment). `HF_HUB_OFFLINE=1` in the
environment turns this into a check of what the cache already holds
(local mode, or a cache someone else filled).

I/O module.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from pdcluster.runtime.engine.model_dir import ModelDirError, hf_snapshot_dir
from pdcluster.runtime.spec import ModelSourceKind, SpecError, parse_model_uri


def fetch_hf_model(uri: str, cache: Path, token: str | None, offline: bool) -> Path:
    """The snapshot folder of `uri` in `cache`, downloaded first unless `offline`."""
    source = parse_model_uri(uri)
    if source.kind is not ModelSourceKind.hf:
        raise SpecError(f"fetch-model: {uri!r} is not an hf:// source")
    if not offline:
        from huggingface_hub import snapshot_download

        snapshot_download(
            repo_id=source.repo, revision=source.revision, cache_dir=str(cache), token=token
        )
    snapshot = hf_snapshot_dir(cache, source.repo, source.revision)
    if not (snapshot / "config.json").is_file():
        raise ModelDirError(f"model source {uri}: {snapshot} has no config.json")
    return snapshot


def cmd_fetch_model(args: argparse.Namespace) -> int:
    token = None
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip() or None
        except OSError as err:
            raise SystemExit(f"pdcluster fetch-model: {args.token_file}: {err.strerror}") from None
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        snapshot = fetch_hf_model(args.uri, Path(args.cache), token, offline)
    except (SpecError, ModelDirError) as err:
        raise SystemExit(f"pdcluster fetch-model: {err}") from None
    except Exception as err:  # the hub's errors: network, 401/404, disk
        raise SystemExit(
            f"pdcluster fetch-model: model source {args.uri}: download into {args.cache} "
            f"failed: {type(err).__name__}: {err}"
        ) from None
    print(f"model source {args.uri}: ready at {snapshot}", flush=True)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    f = sub.add_parser("fetch-model", help="download an hf:// model into a Hugging Face cache")
    f.add_argument("uri", help="hf://ORG/NAME[@REVISION]")
    f.add_argument("--cache", required=True, help="the hub cache folder (HF_HUB_CACHE)")
    f.add_argument("--token-file", help="a file holding the Hugging Face token")
    f.set_defaults(fn=cmd_fetch_model)
