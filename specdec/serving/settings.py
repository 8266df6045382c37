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


TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")
LOG_LEVELS = ["debug", "info", "warning", "error"]  # --log-level of every service


def _coerce(value: str, kind: type) -> Any:
    if kind is bool:
        text = value.strip().lower()
        if text not in TRUE + FALSE:
            raise ValueError(f"expected true or false (1/0, yes/no, on/off), got {value!r}")
        return text in TRUE
    return kind(value)


def env_default(flag: str, default: Any) -> Any:
    """SPECDEC_<FLAG>, or the default when it is unset: for a boolean flag the value, else the
    text, which argparse converts with the flag's `type` as it would the command line's (so a
    bad value is refused naming the flag, not with a traceback)."""
    value = os.environ.get(env_name(flag))
    if value is None:
        return default
    if isinstance(default, bool):
        try:
            return _coerce(value, bool)
        except ValueError as exc:
            raise SystemExit(f"{env_name(flag)}: {exc}") from None
    return value


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
        # a SPECDEC_* value stays text: argparse converts a text default with the flag's type,
        # so it is checked (pattern, choices) as the same value on the command line would be
        env = os.environ.get(env_name(flag))
        if env is not None:
            default = env
        help_text = (
            f"{field.metadata.get('help', '')} [env {env_name(flag)}; default {field.default!r}]"
        )
        if kind is bool:
            if env is not None:
                try:
                    default = _coerce(env, bool)
                except ValueError as exc:
                    parser.error(f"{env_name(flag)}: {exc}")
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
        else:
            convert = flag_type(kind, field.metadata)
            parser.add_argument(
                flag,
                type=convert if env is None else _naming_variable(convert, env_name(flag), env),
                default=default,
                help=help_text,
                choices=field.metadata.get("choices"),
            )


def flag_type(kind: type, meta: dict):
    """An argparse type for a field: the value converted and checked against the field's
    pattern or choices (argparse itself checks choices on the command line only, not on a
    default, which is where a SPECDEC_* value goes)."""
    convert = kind if "pattern" not in meta else _matching(kind, meta["pattern"], meta["help"])
    choices = meta.get("choices")
    if not choices:
        return convert

    def one_of(text: str) -> Any:
        value = convert(text)
        if value not in choices:
            expected = " | ".join(map(str, choices))
            raise argparse.ArgumentTypeError(f"expected one of {expected}, got {text!r}")
        return value

    return one_of


def _naming_variable(convert, variable: str, value: str):
    """An argparse type that, when the refused text is the variable's, says it came from there
    (argparse names only the flag, and the command line may not hold it at all)."""

    def checked(text: str) -> Any:
        try:
            return convert(text)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            if text != value:
                raise
            reason = str(exc) if isinstance(exc, argparse.ArgumentTypeError) else None
            reason = reason or f"invalid {getattr(convert, '__name__', 'value')} value: {text!r}"
            raise argparse.ArgumentTypeError(f"{reason} (from {variable})") from None

    return checked


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
