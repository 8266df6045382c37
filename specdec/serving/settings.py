"""Command-line flags that also read SPECDEC_<FLAG> environment variables.

Each service declares its flags with `flag()`; `parse()` builds the service's settings
dataclass. Precedence: command line, then environment, then the default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
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


def add_flags(
    parser: argparse.ArgumentParser, settings_cls: type, only: tuple[str, ...] | None = None
) -> None:
    """Add one flag per field of a settings dataclass (or of the fields named in `only`);
    field metadata carries the help, the choices and a pattern a value must match."""
    for field in dataclasses.fields(settings_cls):
        if only is not None and field.name not in only:
            continue
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
            pattern = field.metadata.get("pattern")
            parser.add_argument(
                flag,
                type=kind if pattern is None else _matching(kind, pattern, field.metadata["help"]),
                default=default,
                help=help_text,
                choices=field.metadata.get("choices"),
            )


def _matching(kind: type, pattern: str, expected: str):
    """An argparse type: the value converted, if its text matches `pattern` whole."""

    def convert(text: str) -> Any:
        if re.fullmatch(pattern, text) is None:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return kind(text)

    return convert


def from_args(settings_cls: type, args: argparse.Namespace):
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(settings_cls)}
    return settings_cls(**values)


def opt(default: Any, help: str, choices: list | None = None, pattern: str = "") -> Any:
    """A settings field with help text (and optional choices, or a regular expression its
    values must match whole)."""
    meta = {"help": help}
    if choices:
        meta["choices"] = choices
    if pattern:
        meta["pattern"] = pattern
    return dataclasses.field(default=default, metadata=meta)
