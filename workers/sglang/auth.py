"""API keys of SGLang servers started with ``--api-key`` (every route but health and metrics wants
``Authorization: Bearer <key>``) and ``--admin-api-key`` (``/abort_request`` wants that one).

A key never travels through Redis, records, status or Flower: the config names where each process finds it
(an environment variable or a secret file, ``KeyRef``), the ledger's dataset spec carries only that name,
and every worker and the submit read the key from their own environment or file.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

#: A secret file is read again after this long (a rotated key is picked up without a restart).
FILE_TTL_S: Final = 60.0


class MissingKey(Exception):
    """The environment variable or file a key should come from is absent or empty here."""


@dataclass(frozen=True, slots=True)
class KeyRef:
    """Where a process finds a key: exactly one of an environment variable and a file."""

    env: str | None = None
    file: str | None = None

    def __post_init__(self) -> None:
        if (self.env is None) == (self.file is None):
            raise ValueError("a key comes from exactly one of an environment variable and a file")

    def describe(self) -> str:
        return f"environment variable {self.env}" if self.env else f"file {self.file}"

    def as_dict(self) -> dict[str, str]:
        return {"env": self.env} if self.env else {"file": str(self.file)}

    @classmethod
    def of(cls, data: Mapping[str, Any] | None) -> KeyRef | None:
        if not data:
            return None
        return cls(env=data.get("env"), file=data.get("file"))


@dataclass(frozen=True, slots=True)
class ServerAuth:
    """The keys of one server, as read by this process."""

    api_key: str | None = None
    admin_api_key: str | None = None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def admin_headers(self) -> dict[str, str]:
        key = self.admin_api_key or self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def __repr__(self) -> str:  # never show a key
        return (
            f"ServerAuth(api_key={'***' if self.api_key else None}, "
            f"admin_api_key={'***' if self.admin_api_key else None})"
        )


NO_AUTH: Final = ServerAuth()

_cache: dict[str, tuple[float, str]] = {}
_cache_lock = threading.Lock()


def read_key(ref: KeyRef, env: Mapping[str, str] | None = None) -> str:
    """The key ``ref`` names, from this process's environment or the file. Raises ``MissingKey``."""
    if ref.env is not None:
        value = (os.environ if env is None else env).get(ref.env, "").strip()
        if not value:
            raise MissingKey(f"the {ref.describe()} is not set")
        return value
    assert ref.file is not None
    now = time.monotonic()
    with _cache_lock:
        cached = _cache.get(ref.file)
        if cached is not None and now - cached[0] < FILE_TTL_S:
            return cached[1]
    try:
        value = Path(ref.file).read_text().strip()
    except OSError as e:
        raise MissingKey(f"cannot read the {ref.describe()}: {e.strerror or e}") from None
    if not value:
        raise MissingKey(f"the {ref.describe()} is empty")
    with _cache_lock:
        _cache[ref.file] = (now, value)
    return value


def server_auth(refs: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> ServerAuth:
    """The keys of one server from its spec entry ``{"api_key": {...}, "admin_api_key": {...}}``."""
    if not refs:
        return NO_AUTH
    api, admin = KeyRef.of(refs.get("api_key")), KeyRef.of(refs.get("admin_api_key"))
    return ServerAuth(
        api_key=read_key(api, env) if api else None,
        admin_api_key=read_key(admin, env) if admin else None,
    )
