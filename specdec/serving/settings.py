"""Command-line flags that also read SPECDEC_<FLAG> environment variables.

Each service declares its flags with `flag()`; `parse()` builds the service's settings
dataclass. Precedence: command line, then environment, then the default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any


def env_name(flag: str) -> str:
    return "SPECDEC_" + flag.lstrip("-").upper().replace("-", "_")


def _coerce(value: str, kind: type) -> Any:
    if kind is bool:
        return value.strip().lower() in ("1", "true", "yes", "on")
    return kind(value)


def env_default(flag: str, default: Any) -> Any:
    """SPECDEC_<FLAG> coerced to the default's type, or the default when it is unset."""
    value = os.environ.get(env_name(flag))
    return default if value is None else _coerce(value, type(default))


def add_flags(parser: argparse.ArgumentParser, settings_cls: type) -> None:
    """Add one flag per field of a settings dataclass; field metadata carries the help."""
    for field in dataclasses.fields(settings_cls):
        flag = "--" + field.name.replace("_", "-")
        kind = field.type if isinstance(field.type, type) else eval(field.type)  # noqa: S307
        default = field.default
        env = os.environ.get(env_name(flag))
        if env is not None:
            default = _coerce(env, kind)
        help_text = (
            f"{field.metadata.get('help', '')} [env {env_name(flag)}; default {field.default!r}]"
        )
        if kind is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
        else:
            parser.add_argument(
                flag,
                type=kind,
                default=default,
                help=help_text,
                choices=field.metadata.get("choices"),
            )


def from_args(settings_cls: type, args: argparse.Namespace):
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(settings_cls)}
    return settings_cls(**values)


def opt(default: Any, help: str, choices: list | None = None) -> Any:
    """A settings field with help text (and optional choices)."""
    meta = {"help": help}
    if choices:
        meta["choices"] = choices
    return dataclasses.field(default=default, metadata=meta)
