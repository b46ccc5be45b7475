"""The model's volume in a worker pod, for any engine kind: `spec.model.source`.

`build_model_mount` says what a pod needs so its engine finds the model at
a fixed place, whatever the engine container is (the engine builder adds
the mounts and variables to its container and passes `model_dir` or the
variables on to its engine):

- `pvc://CLAIM/PATH`: volume `model` = the claim, read-only at /models;
  PDCLUSTER_MODEL_DIR=/models/PATH;
- `host:///PATH`: volume `model` = hostPath PATH (a Directory), read-only;
  PDCLUSTER_MODEL_DIR=/models;
- `oci://IMAGE`: volume `model` = an image volume of IMAGE;
  PDCLUSTER_MODEL_DIR=/models;
- `hf://ORG/NAME@REV`: volume `model` = the `cacheClaim` PVC; the init
  container `fetch-model` downloads into it (read-write, the token Secret
  mounted as a file); the engine container reads it read-only with
  HF_HUB_CACHE=/models/hub and HF_HUB_OFFLINE=1.

The worker resolves the folder from these (runtime/engine/model_dir.py)
and fails with a message naming the source when it holds no model.

Pure module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdcluster.operator.builders import meta, podsecurity
from pdcluster.runtime.spec import MODEL_MOUNT_PATH, ModelSourceKind, PDClusterSpec
from pdcluster.runtime.spec.model_source import HF_CACHE_SUBDIR, HF_TOKEN_KEY

MODEL_VOLUME = "model"
MODEL_DIR_ENV = "PDCLUSTER_MODEL_DIR"  # runtime/engine/model_dir.py reads it
HF_TOKEN_VOLUME = "hf-token"
HF_TOKEN_DIR = f"{podsecurity.SECRETS_DIR}/hf-token"
FETCH_CONTAINER = "fetch-model"


@dataclass(frozen=True)
class ModelMount:
    """What a worker pod adds for its model; empty for `tiny` or a plain `path`."""

    volumes: tuple[dict[str, Any], ...] = ()
    mounts: tuple[dict[str, Any], ...] = ()  # of the engine container
    env: tuple[dict[str, Any], ...] = ()  # of the engine container
    init_containers: tuple[dict[str, Any], ...] = ()
    # The model folder inside the pod when known before start (None: hf://, or no source).
    model_dir: str | None = None
    # hf://: the repository and revision an engine that reads the hub cache itself is given.
    hf_repo: str | None = None
    hf_revision: str | None = None
    secrets: tuple[str, ...] = field(default=())  # Secrets the pod reads (policy checks them)


def _fetch_container(
    spec: PDClusterSpec, uri: str, cache_dir: str, token_secret: str | None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The init container that downloads an hf:// model, and the volumes only it uses."""
    mounts: list[dict[str, Any]] = [
        {"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT_PATH},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    volumes: list[dict[str, Any]] = []
    args = ["fetch-model", uri, "--cache", cache_dir]
    if token_secret is not None:
        volumes.append(podsecurity.secret_volume(HF_TOKEN_VOLUME, token_secret, HF_TOKEN_KEY))
        mounts.append({"name": HF_TOKEN_VOLUME, "mountPath": HF_TOKEN_DIR, "readOnly": True})
        args += ["--token-file", f"{HF_TOKEN_DIR}/{HF_TOKEN_KEY}"]
    container = {
        "name": FETCH_CONTAINER,
        "image": spec.image,
        "command": ["pdcluster"],
        "args": args,
        "env": [meta.env_value("HOME", podsecurity.HOME_DIR)],
        "resources": podsecurity.with_default_requests({}, "router"),
        "securityContext": podsecurity.container_security_context(),
        "volumeMounts": mounts,
    }
    return container, volumes


def build_model_mount(spec: PDClusterSpec) -> ModelMount:
    """The model volume, mounts, variables and init container of a worker pod."""
    if spec.model.source is None:
        return ModelMount()
    source_spec = spec.model.source
    source = source_spec.parsed
    read_only = {"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT_PATH, "readOnly": True}
    if source.kind is ModelSourceKind.hf:
        assert source_spec.cache_claim is not None  # the model requires it for hf://
        cache_dir = f"{MODEL_MOUNT_PATH}/{HF_CACHE_SUBDIR}"
        volume = {
            "name": MODEL_VOLUME,
            "persistentVolumeClaim": {"claimName": source_spec.cache_claim},
        }
        fetch, fetch_volumes = _fetch_container(
            spec, source.uri, cache_dir, source_spec.token_secret_name
        )
        secret = (source_spec.token_secret_name,) if source_spec.token_secret_name else ()
        return ModelMount(
            volumes=(volume, *fetch_volumes),
            mounts=(read_only,),
            env=(
                meta.env_value("HF_HUB_CACHE", cache_dir),
                # Everything was downloaded by the init container: never reach out again.
                meta.env_value("HF_HUB_OFFLINE", "1"),
            ),
            init_containers=(fetch,),
            hf_repo=source.repo,
            hf_revision=source.revision,
            secrets=secret,
        )
    if source.kind is ModelSourceKind.pvc:
        volume = {
            "name": MODEL_VOLUME,
            "persistentVolumeClaim": {"claimName": source.claim, "readOnly": True},
        }
        model_dir = f"{MODEL_MOUNT_PATH}/{source.path}" if source.path else MODEL_MOUNT_PATH
    elif source.kind is ModelSourceKind.host:
        volume = {"name": MODEL_VOLUME, "hostPath": {"path": source.path, "type": "Directory"}}
        model_dir = MODEL_MOUNT_PATH
    else:
        image: dict[str, Any] = {"reference": source.image}
        if source_spec.pull_policy is not None:
            image["pullPolicy"] = source_spec.pull_policy
        volume = {"name": MODEL_VOLUME, "image": image}
        model_dir = MODEL_MOUNT_PATH
    return ModelMount(
        volumes=(volume,),
        mounts=(read_only,),
        env=(meta.env_value(MODEL_DIR_ENV, model_dir),),
        model_dir=model_dir,
    )
