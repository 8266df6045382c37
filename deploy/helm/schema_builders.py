"""The generic JSON-schema builders of the chart's values schema: typed scalars, objects whose
unknown keys are typos, and Kubernetes structures passed through verbatim. Used by
schema_tiers.py, schema_cluster.py and gen_schema.py."""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]


def obj(properties: dict[str, Schema], description: str = "", *, open_: bool = False) -> Schema:
    """An object with known keys; unknown keys are typos unless `open_`."""
    schema: Schema = {"type": "object", "properties": properties}
    if not open_:
        schema["additionalProperties"] = False
    if description:
        schema["description"] = description
    return schema


def integer(
    minimum: int | None = None, maximum: int | None = None, *, nullable: bool = False
) -> Schema:
    schema: Schema = {"type": ["integer", "null"] if nullable else "integer"}
    if minimum is not None:
        schema["minimum"] = minimum
    if maximum is not None:
        schema["maximum"] = maximum
    return schema


def number(*, positive: bool = False, nullable: bool = False) -> Schema:
    """A non-negative (or strictly positive) number, e.g. seconds or milliseconds."""
    schema: Schema = {"type": ["number", "null"] if nullable else "number"}
    schema["exclusiveMinimum" if positive else "minimum"] = 0
    return schema


def string(enum: list[str] | None = None, *, nullable: bool = False) -> Schema:
    schema: Schema = {"type": ["string", "null"] if nullable else "string"}
    if enum is not None:
        schema["enum"] = enum + ([None] if nullable else [])
    return schema


def boolean() -> Schema:
    return {"type": "boolean"}


def k8s_object(description: str) -> Schema:
    """A Kubernetes structure passed through verbatim (affinity, securityContext, ...)."""
    return {"type": "object", "description": description}


def k8s_list(description: str) -> Schema:
    return {"type": "array", "items": {"type": "object"}, "description": description}


def string_map(description: str) -> Schema:
    return {
        "type": "object",
        "additionalProperties": {"type": "string"},
        "description": description,
    }


PORT = integer(1, 65535)
METRICS_PORT = integer(0, 65535)
REPLICAS = integer(0)
KEY = {"type": "string", "minLength": 1}


def resources() -> Schema:
    quantities = {"type": "object", "additionalProperties": {"type": ["string", "number"]}}
    return obj({"requests": quantities, "limits": quantities}, "container resources", open_=True)
