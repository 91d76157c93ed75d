"""The one error a user sees for a config mistake: ``ConfigError``, a line naming the file and line."""

from __future__ import annotations

import json
import os

from budget.urls import redact_url


class ConfigError(Exception):
    """A config problem. ``str()`` is one user-facing line: ``file:LINE: message``.

    ``file`` and ``line`` are optional: without a line it is ``file: message``, without a file just the
    message.
    """

    def __init__(
        self,
        message: str,
        *,
        file: str | os.PathLike[str] | None = None,
        line: int | None = None,
    ) -> None:
        self.message = " ".join(message.split())
        self.file = os.fspath(file) if file is not None else None
        self.line = line
        super().__init__(self._render())

    def _render(self) -> str:
        if self.file is None:
            return self.message
        if self.line is None:
            return f"{self.file}: {self.message}"
        return f"{self.file}:{self.line}: {self.message}"

    def __str__(self) -> str:
        return self._render()


# ------------------------------------------------------------------------------------------ redaction

# ------------------------------------------------------------------------------------------ validators


def _quote(value: object) -> str:
    """A value as the user would write it in TOML/JSON, credentials masked."""
    if isinstance(value, str):
        return json.dumps(redact_url(value), ensure_ascii=False)
    return json.dumps(value) if isinstance(value, bool | int | float) or value is None else repr(value)
