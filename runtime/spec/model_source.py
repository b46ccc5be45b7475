"""Where a cluster's model weights come from: `spec.model.source`.

One URI names the source, in the scheme of the storage that holds it:

- `pvc://CLAIM[/PATH]`: the PersistentVolumeClaim CLAIM, mounted read-only
  at `MODEL_MOUNT_PATH` (/models); the model is `/models/PATH`;
- `host:///ABS/PATH`: the node's folder ABS/PATH (hostPath), read-only at
  /models, which is the model;
- `oci://IMAGE`: an image volume of IMAGE (Kubernetes image volumes) at
  /models, which is the model;
- `hf://ORG/NAME[@REVISION]`: the PVC `cacheClaim` holding a Hugging Face
  cache at /models; the model is that cache's snapshot of ORG/NAME at
  REVISION (default `main`).

An `hf://` model is downloaded once into the cache claim by an init
container (with the token of `tokenSecretName`, key `HF_TOKEN`, when
given) and the worker then reads it with the hub offline. The folder a
pod's engine loads is decided in one place for every engine kind
(`runtime/model_dir.py` on the worker; the operator's builders mount).

Invariants (mirrored as CEL rules): the URI parses; `cacheClaim` and
`tokenSecretName` belong to `hf://` only and `cacheClaim` is required
there; `pullPolicy` belongs to `oci://` only; a model with a source sets
no `path` (the source decides it).

Pure module.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Literal

from pydantic import Field, model_validator

from pdcluster.runtime.spec.base import SpecError, SpecModel

# Where every pod sees the model (or the Hugging Face cache, for hf://).
MODEL_MOUNT_PATH = "/models"
# Inside the cache claim of an hf:// source: the hub's cache folder (HF_HUB_CACHE).
HF_CACHE_SUBDIR = "hub"
HF_TOKEN_KEY = "HF_TOKEN"
HF_DEFAULT_REVISION = "main"

_DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?"
_CLAIM = re.compile(rf"^{_DNS_SUBDOMAIN}$")
# Repository ids of the hub: ORG/NAME, letters, digits, '-', '_', '.'.
_HF_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_HF_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
# An image reference: registry/repository[:tag][@digest], no spaces or schemes.
_IMAGE = re.compile(r"^[a-z0-9][a-z0-9._/:@-]*[A-Za-z0-9]$", re.IGNORECASE)
# The URI as CEL checks it: the scheme and a non-empty rest (the models check more).
URI_PATTERN = r"^(pvc|host|oci|hf)://.+$"


class ModelSourceKind(enum.StrEnum):
    pvc = "pvc"
    host = "host"
    oci = "oci"
    hf = "hf"


@dataclass(frozen=True)
class ModelSource:
    """A parsed `source.uri`: which storage, and where in it the model is."""

    kind: ModelSourceKind
    uri: str
    claim: str = ""  # pvc: the claim
    path: str = ""  # pvc: the folder inside the claim ("" is its root); host: the node path
    image: str = ""  # oci: the image reference
    repo: str = ""  # hf: ORG/NAME
    revision: str = HF_DEFAULT_REVISION  # hf: a branch, tag or commit


def _safe_relative(path: str, uri: str) -> str:
    parts = [p for p in path.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise SpecError(f"model.source.uri {uri!r}: the path may not contain '.' or '..'")
    return "/".join(parts)


def parse_model_uri(uri: str) -> ModelSource:
    """`uri` as a ModelSource; SpecError naming `model.source.uri` and what is wrong."""
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme not in ModelSourceKind.__members__:
        accepted = ", ".join(f"{k.value}://" for k in ModelSourceKind)
        raise SpecError(f"model.source.uri {uri!r}: expected one of {accepted}")
    kind = ModelSourceKind(scheme)
    if kind is ModelSourceKind.pvc:
        claim, _, path = rest.partition("/")
        if not _CLAIM.match(claim) or len(claim) > 253:
            raise SpecError(
                f"model.source.uri {uri!r}: pvc://CLAIM/PATH needs a claim name "
                "(a DNS-1123 subdomain)"
            )
        return ModelSource(kind, uri, claim=claim, path=_safe_relative(path, uri))
    if kind is ModelSourceKind.host:
        if not rest.startswith("/") or rest == "/":
            raise SpecError(
                f"model.source.uri {uri!r}: host:///ABS/PATH needs an absolute node path"
            )
        return ModelSource(kind, uri, path="/" + _safe_relative(rest, uri))
    if kind is ModelSourceKind.oci:
        if not _IMAGE.match(rest) or len(rest) > 512:
            raise SpecError(f"model.source.uri {uri!r}: oci://IMAGE needs an image reference")
        return ModelSource(kind, uri, image=rest)
    repo, _, revision = rest.partition("@")
    parts = repo.split("/")
    if len(parts) != 2 or not all(_HF_PART.match(p) for p in parts):
        raise SpecError(f"model.source.uri {uri!r}: hf://ORG/NAME[@REVISION] needs ORG/NAME")
    if revision and (not _HF_REVISION.match(revision) or ".." in revision):
        raise SpecError(f"model.source.uri {uri!r}: bad revision {revision!r}")
    return ModelSource(kind, uri, repo=repo, revision=revision or HF_DEFAULT_REVISION)


class ModelSourceSpec(SpecModel):
    """Where the model's weights are read from (see docs/kubernetes.md, Model sources)."""

    uri: str = Field(min_length=6, max_length=1024, pattern=URI_PATTERN)
    # hf:// only: the PVC holding the Hugging Face cache the model is downloaded into.
    cache_claim: str | None = Field(
        default=None, min_length=1, max_length=253, pattern=rf"^{_DNS_SUBDOMAIN}$"
    )
    # hf:// only: a Secret whose key HF_TOKEN the download uses (gated models).
    token_secret_name: str | None = Field(
        default=None, min_length=1, max_length=253, pattern=rf"^{_DNS_SUBDOMAIN}$"
    )
    # oci:// only: the image volume's pull policy.
    pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None

    @model_validator(mode="after")
    def _fields_of_the_scheme(self) -> ModelSourceSpec:
        try:
            source = parse_model_uri(self.uri)
        except SpecError as err:
            raise ValueError(str(err)) from None
        is_hf = source.kind is ModelSourceKind.hf
        if is_hf and self.cache_claim is None:
            raise ValueError("model.source: an hf:// source needs cacheClaim (the cache PVC)")
        if not is_hf and (self.cache_claim is not None or self.token_secret_name is not None):
            raise ValueError("model.source: cacheClaim and tokenSecretName belong to hf:// only")
        if source.kind is not ModelSourceKind.oci and self.pull_policy is not None:
            raise ValueError("model.source: pullPolicy belongs to oci:// only")
        return self

    @property
    def parsed(self) -> ModelSource:
        return parse_model_uri(self.uri)


@dataclass(frozen=True)
class EngineModel:
    """What an engine that takes a folder or a hub id is given for a model: the
    folder the pod mounted, or (hf://) the repository and revision, which it
    reads from the hub cache the pod mounted (HF_HUB_CACHE, offline)."""

    location: str
    revision: str | None = None


def engine_model(path: str | None, source: ModelSourceSpec | None) -> EngineModel:
    """The model argument of an engine's command line, for `model.path` or `model.source`."""
    if source is None:
        if not path:
            raise SpecError("model: neither path nor source names a model folder")
        return EngineModel(path)
    parsed = source.parsed
    if parsed.kind is ModelSourceKind.hf:
        return EngineModel(parsed.repo, parsed.revision)
    if parsed.kind is ModelSourceKind.pvc and parsed.path:
        return EngineModel(f"{MODEL_MOUNT_PATH}/{parsed.path}")
    return EngineModel(MODEL_MOUNT_PATH)
