"""What every manifest model shares: the camelCase model base and SpecError.

A section of the manifest that has a module of its own (e.g. the engine a
cluster runs, a pod overlay) builds on `SpecModel`, so every section reads
camelCase on the wire, rejects unknown fields and is immutable.

Pure module.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class SpecError(ValueError):
    """A manifest is invalid; the message names the field and the problem."""


class SpecModel(BaseModel):
    """Base of every manifest section: camelCase aliases, unknown fields refused, frozen."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )
