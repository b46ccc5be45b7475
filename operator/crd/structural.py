"""Turn a pydantic JSON schema into a Kubernetes structural schema.

Kubernetes accepts only a subset of JSON Schema in a CRD: every node names
its `type`, there are no `$ref`s, `anyOf` cannot carry types, numeric
exclusive bounds are booleans next to `minimum`/`maximum`, and free-form
objects must say `x-kubernetes-preserve-unknown-fields: true` (or the
apiserver prunes their content). This module does that translation:

- `$ref` is inlined; `Optional[X]` (anyOf X | null) becomes X with
  `nullable: true`;
- an object field whose default is a whole sub-model keeps that default in
  full (without nulls): the apiserver validates defaults against CEL rules
  without filling nested defaults first, so `{}` would fail a rule;
- `additionalProperties: true` becomes preserve-unknown-fields, a typed
  `additionalProperties` stays (a map), `additionalProperties: false` is
  dropped (the apiserver prunes unknown fields of a structural schema);
- titles and pydantic-only keys are dropped; descriptions stay for
  `kubectl explain`.

`check_structural` lists the violations of a converted schema, so tests and
the generator fail loudly instead of the apiserver rejecting the CRD later.

Pure module.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

Schema = dict[str, Any]

_KEEP = {
    "type",
    "description",
    "default",
    "enum",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "pattern",
    "format",
    "required",
    "nullable",
}
_ALLOWED = _KEEP | {
    "properties",
    "items",
    "additionalProperties",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-validations",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-map-type",
}


class SchemaConversionError(ValueError):
    """A pydantic schema uses a construct that has no structural equivalent."""


def to_structural(schema: Schema) -> Schema:
    """Convert a pydantic `model_json_schema()` result; the input is not modified."""
    defs = schema.get("$defs", {})
    root = {k: v for k, v in schema.items() if k != "$defs"}
    return _convert(root, defs, "<root>")


def _resolve(node: Schema, defs: dict[str, Schema], where: str) -> Schema:
    ref = node.get("$ref")
    if ref is None:
        return node
    prefix = "#/$defs/"
    if not ref.startswith(prefix) or ref[len(prefix) :] not in defs:
        raise SchemaConversionError(f"{where}: unresolvable $ref {ref!r}")
    target = copy.deepcopy(defs[ref[len(prefix) :]])
    # Keys beside the $ref (default, description) override the definition's.
    target.update({k: v for k, v in node.items() if k != "$ref"})
    return target


def _split_nullable(node: Schema, where: str) -> tuple[Schema, bool]:
    variants = node.get("anyOf")
    if variants is None:
        return node, False
    non_null = [v for v in variants if v.get("type") != "null"]
    if len(non_null) != 1 or len(non_null) == len(variants):
        raise SchemaConversionError(f"{where}: only Optional[X] unions are supported")
    merged = dict(non_null[0])
    merged.update({k: v for k, v in node.items() if k != "anyOf"})
    return merged, True


def _convert(node: Schema, defs: dict[str, Schema], where: str) -> Schema:
    node, nullable = _split_nullable(_resolve(node, defs, where), where)
    node = _resolve(node, defs, where)
    if "allOf" in node or "oneOf" in node or "not" in node:
        raise SchemaConversionError(f"{where}: allOf/oneOf/not have no structural equivalent")
    if "const" in node:
        node = {**node, "enum": [node["const"]]}
    kind = node.get("type")
    if kind is None and "enum" in node:
        kinds = {type(v).__name__ for v in node["enum"]}
        if kinds != {"str"}:
            raise SchemaConversionError(f"{where}: only string enums are supported")
        kind = "string"
    if kind is None:
        raise SchemaConversionError(f"{where}: every schema node needs a type")

    out: Schema = {"type": kind}
    for key in ("description", "enum", "minLength", "maxLength", "pattern", "format"):
        if key in node:
            out[key] = node[key]
    for key in ("minItems", "maxItems"):
        if key in node:
            out[key] = node[key]
    _convert_bounds(node, out)
    if nullable:
        out["nullable"] = True

    if kind == "object":
        _convert_object(node, out, defs, where)
    elif kind == "array":
        if "items" not in node:
            raise SchemaConversionError(f"{where}: arrays need an item schema")
        out["items"] = _convert(node["items"], defs, f"{where}[]")

    if "default" in node and node["default"] is not None:
        # Defaults are spelled out in full (nulls dropped): the apiserver checks a
        # default against CEL rules without first filling the nested defaults.
        out["default"] = _drop_nulls(node["default"])
    return out


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _convert_bounds(node: Schema, out: Schema) -> None:
    for key in ("minimum", "maximum"):
        if key in node:
            out[key] = node[key]
    for key, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if key in node:
            value = node[key]
            if isinstance(value, bool):
                out[key] = value
            else:
                out[plain] = value
                out[key] = True


def _convert_object(node: Schema, out: Schema, defs: dict[str, Schema], where: str) -> None:
    props = node.get("properties")
    extra = node.get("additionalProperties")
    if props:
        out["properties"] = {
            name: _convert(sub, defs, f"{where}.{name}") for name, sub in props.items()
        }
        if node.get("required"):
            out["required"] = list(node["required"])
        if extra not in (None, False):
            raise SchemaConversionError(f"{where}: properties and additionalProperties both set")
        return
    if extra is True or extra is None or extra == {}:
        out["x-kubernetes-preserve-unknown-fields"] = True
    elif isinstance(extra, dict):
        out["additionalProperties"] = _convert(extra, defs, f"{where}.*")


def walk(schema: Schema, where: str = "<root>") -> Iterator[tuple[str, Schema]]:
    """Every node of a structural schema with a dotted path."""
    yield where, schema
    for name, sub in schema.get("properties", {}).items():
        yield from walk(sub, f"{where}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from walk(schema["items"], f"{where}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], f"{where}.*")


def check_structural(schema: Schema) -> list[str]:
    """Violations of the structural-schema rules this project relies on (empty: fine)."""
    problems: list[str] = []
    for where, node in walk(schema):
        unknown = set(node) - _ALLOWED
        if unknown:
            problems.append(f"{where}: keys not allowed in a structural schema: {sorted(unknown)}")
        if "type" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            problems.append(f"{where}: no type")
        if "properties" in node and "additionalProperties" in node:
            problems.append(f"{where}: properties and additionalProperties are exclusive")
        if node.get("type") == "array" and "items" not in node:
            problems.append(f"{where}: array without items")
        if node.get("type") == "object" and not (
            "properties" in node
            or "additionalProperties" in node
            or node.get("x-kubernetes-preserve-unknown-fields")
        ):
            problems.append(f"{where}: object with no fields would be pruned empty")
        for key in ("exclusiveMinimum", "exclusiveMaximum"):
            if key in node and not isinstance(node[key], bool):
                problems.append(f"{where}: {key} must be a boolean in OpenAPI v3")
    return problems


def apply_defaults(schema: Schema, value: Any) -> Any:
    """Fill defaults the way the apiserver does: absent fields get their default,
    then defaulting descends into the (possibly just defaulted) value."""
    if isinstance(value, dict) and schema.get("type") == "object":
        result = dict(value)
        for name, sub in schema.get("properties", {}).items():
            if name not in result and "default" in sub:
                result[name] = copy.deepcopy(sub["default"])
            if name in result:
                result[name] = apply_defaults(sub, result[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name in result:
                result[name] = apply_defaults(extra, result[name])
        return result
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(schema["items"], item) for item in value]
    return value
