"""Pydantic's and tomllib's errors in the words a user reads: one line with the file and the line."""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Mapping
from typing import Any, Final

from pydantic import (
    ValidationError,
)
from pydantic_core import ErrorDetails

from tokenfleet.config.errors import ConfigError, _quote
from tokenfleet.config.models import _SAMPLING_ERROR, ServerConfig, _ConfigFile, _DatasetTable, _suggest
from tokenfleet.config.toml_lines import Loc, _KeyLocator

_TOML_POSITION_RE: Final = re.compile(r"^(?P<msg>.*?)\s*\(at line (?P<line>\d+), column (?P<col>\d+)\)$")


def _toml_syntax_error(exc: tomllib.TOMLDecodeError, shown: str) -> ConfigError:
    text = str(exc)
    line = getattr(exc, "lineno", None)
    col = getattr(exc, "colno", None)
    msg = getattr(exc, "msg", None)
    m = _TOML_POSITION_RE.match(text)
    if m:
        line, col, msg = int(m["line"]), int(m["col"]), m["msg"]
    if not isinstance(line, int) or not isinstance(msg, str):
        return ConfigError(f"invalid TOML: {_lower_first(text)}", file=shown)
    where = f" (column {col})" if isinstance(col, int) else ""
    return ConfigError(f"invalid TOML: {_lower_first(msg)}{where}", file=shown, line=line)


def _lower_first(s: str) -> str:
    return s[:1].lower() + s[1:] if s[:2] != s[:2].upper() else s


# --------------------------------------------------------------------------- pydantic error translation


_TOP_LEVEL_KEYS: Final = frozenset(_ConfigFile.model_fields)
_TABLE_KEYS: Final[Mapping[Loc, frozenset[str]]] = {
    (): _TOP_LEVEL_KEYS,
    ("server",): frozenset(ServerConfig.model_fields),
}
_DATASET_KEYS: Final = frozenset(_DatasetTable.model_fields)


def _translate(exc: ValidationError, raw: Mapping[str, Any], locator: _KeyLocator, shown: str) -> ConfigError:
    errors = exc.errors(include_url=False)
    message, line_loc = _describe(errors[0], raw)
    if len(errors) > 1:
        more = len(errors) - 1
        message += f" (and {more} more problem{'s' if more > 1 else ''})"
    return ConfigError(message, file=shown, line=locator.line(line_loc))


def _describe(err: ErrorDetails, raw: Mapping[str, Any]) -> tuple[str, Loc]:
    """One readable sentence for a pydantic error, and the TOML location to look for its line."""
    loc: Loc = tuple(err["loc"])
    kind = err["type"]
    ctx = err.get("ctx") or {}

    prefix = ""
    rest = loc
    keys = _TABLE_KEYS.get(loc[:-1])
    if len(loc) >= 2 and loc[0] == "dataset" and isinstance(loc[1], int):
        prefix = _dataset_label(raw, loc[1]) + ": "
        rest = loc[2:]
        keys = _DATASET_KEYS if len(rest) == 1 else None
    field = _dotted(rest)

    if kind == _SAMPLING_ERROR:
        key = ctx.get("key")
        return prefix + str(ctx.get("detail", err["msg"])), (*loc, key) if isinstance(key, str) else loc
    if kind == "extra_forbidden":
        key = str(rest[-1]) if rest else "?"
        message = f'unknown key "{field}"'
        suggestion = _suggest(key, keys) if keys else None
        if suggestion:
            message += f' (did you mean "{suggestion}"?)'
        elif key in _TOP_LEVEL_KEYS and (prefix or len(rest) > 1):
            message += " (top-level keys must come before the first [table] in the file)"
        return prefix + message, loc
    if kind == "missing":
        if loc == ("server",):
            return "missing required table [server]", loc
        if loc == ("dataset",):
            return "no [[dataset]] table: at least one dataset is required", loc
        return f'{prefix}missing required key "{field}"', loc
    if loc == ("dataset",) and kind == "list_type":
        return "dataset must be an array of tables: write each one as [[dataset]]", loc
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return (f"{prefix}{field} must be a table" if field else f"{prefix}must be a table"), loc
    if kind == "too_short" and loc == ("dataset",):
        return "no [[dataset]] table: at least one dataset is required", loc
    if kind == "too_short" and loc == ("server", "urls"):
        return "server.urls: must list at least one URL", loc

    msg = err["msg"]
    if kind == "value_error":
        msg = msg.removeprefix("Value error, ")
        return f"{prefix}{field}: {msg}" if field else prefix + msg, loc
    got = err.get("input")
    shown_input = f" (got {_quote(got)})" if isinstance(got, str | int | float | bool) else ""
    return f"{prefix}{field}: {_lower_first(msg)}{shown_input}" if field else prefix + msg, loc


def _dataset_label(raw: Mapping[str, Any], index: int) -> str:
    tables = raw.get("dataset")
    if isinstance(tables, list) and index < len(tables) and isinstance(tables[index], dict):
        name = tables[index].get("name")
        if isinstance(name, str) and name:
            return f"dataset {json.dumps(name, ensure_ascii=False)}"
    return f"dataset #{index + 1}"


def _dotted(loc: Loc) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


# ---------------------------------------------------------------------------------- line numbers (TOML)
