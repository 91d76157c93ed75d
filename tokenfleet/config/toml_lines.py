"""A small TOML scanner that finds the line of each key, for error messages (tomllib gives none)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Final

Loc = tuple[str | int, ...]


_KEY_PART_RE: Final = re.compile(r"""\s*(?:([A-Za-z0-9_-]+)|"((?:[^"\\]|\\.)*)"|'([^']*)')\s*""")


def _parse_key(s: str, pos: int = 0) -> tuple[tuple[str, ...], int] | None:
    """A (dotted) TOML key at ``s[pos:]``: its parts and the position after it."""
    parts: list[str] = []
    while True:
        m = _KEY_PART_RE.match(s, pos)
        if not m:
            return None
        if m.group(1) is not None:
            parts.append(m.group(1))
        elif m.group(2) is not None:
            try:
                parts.append(json.loads(f'"{m.group(2)}"'))
            except ValueError:
                parts.append(m.group(2))
        else:
            parts.append(m.group(3))
        pos = m.end()
        if pos < len(s) and s[pos] == ".":
            pos += 1
            continue
        return tuple(parts), pos


def _scan(s: str, pos: int, open_string: str | None, depth: int) -> tuple[str | None, int]:
    """Carry TOML lexing state over ``s[pos:]``: the open multi-line string delimiter (or None) and the
    bracket depth of a value that spans lines. Ignores comments and the inside of strings."""
    i, n = pos, len(s)
    while i < n:
        if open_string is not None:
            close = s.find(open_string, i)
            if close < 0:
                return open_string, depth
            i = close + 3
            open_string = None
            continue
        c = s[i]
        if c == "#":
            break
        if s.startswith('"""', i) or s.startswith("'''", i):
            open_string = s[i : i + 3]
            i += 3
            continue
        if c in "\"'":
            i += 1
            while i < n and s[i] != c:
                i += 2 if c == '"' and s[i] == "\\" else 1
            i += 1
            continue
        if c in "[{":
            depth += 1
        elif c in "]}":
            depth = max(0, depth - 1)
        i += 1
    return open_string, depth


class _KeyLocator:
    """Best-effort map from a key's location (as pydantic reports it) to its first line in the TOML.

    tomllib keeps no positions, so this scans the text: table headers, ``[[array]]`` indices, dotted keys;
    it skips multi-line strings and arrays. A location it cannot find falls back to its nearest enclosing
    table or key, and to None.
    """

    def __init__(self, text: str) -> None:
        self._lines: dict[Loc, int] = {}
        table: Loc = ()
        array_index: dict[tuple[str, ...], int] = {}
        depth = 0
        open_string: str | None = None
        for line_no, line in enumerate(text.splitlines(), start=1):
            if open_string is not None or depth > 0:
                # Continuation of a multi-line string or array: no keys or headers here.
                open_string, depth = _scan(line, 0, open_string, depth)
                continue
            stripped = line.strip()
            if not stripped or stripped.startswith("#"):
                continue
            if stripped.startswith("["):
                is_array = stripped.startswith("[[")
                parsed = _parse_key(stripped, 2 if is_array else 1)
                if parsed is None:
                    continue
                path = parsed[0]
                if is_array:
                    array_index[path] = array_index.get(path, -1) + 1
                    for nested in [k for k in array_index if len(k) > len(path) and k[: len(path)] == path]:
                        del array_index[nested]
                table = self._with_indices(path, array_index)
                self._record(table, line_no)
                continue
            parsed = _parse_key(line)
            if parsed is None or parsed[1] >= len(line) or line[parsed[1]] != "=":
                continue
            key, end = parsed
            self._record((*table, *key), line_no)
            open_string, depth = _scan(line, end + 1, None, 0)

    @staticmethod
    def _with_indices(path: tuple[str, ...], array_index: Mapping[tuple[str, ...], int]) -> Loc:
        loc: list[str | int] = []
        for i, part in enumerate(path):
            loc.append(part)
            index = array_index.get(path[: i + 1])
            if index is not None:
                loc.append(index)
        return tuple(loc)

    def _record(self, loc: Loc, line_no: int) -> None:
        for n in range(1, len(loc) + 1):
            self._lines.setdefault(loc[:n], line_no)

    def line(self, loc: Sequence[str | int]) -> int | None:
        """The line of ``loc``, else of its nearest recorded parent, else None."""
        loc = tuple(loc)
        for n in range(len(loc), 0, -1):
            found = self._lines.get(loc[:n])
            if found is not None:
                return found
        return None
