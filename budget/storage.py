"""Markers in the output folder that tie it to the ledger.

- The **storage marker**, ``OUTPUT_DIR/.tokenfleet-storage``, holds a random token that ``submit`` also
  puts in each dataset's spec (``storage_token``). A worker that reads ``output_dir`` from the spec and
  finds another token there (or none) writes to other storage than submit saw: a different disk mounted at
  the same path, a host without the shared volume. `check_same_storage` says so.
- The **epoch marker**, ``OUTPUT_DIR/NAME/.tokenfleet-epoch``, holds the random epoch of dataset NAME's
  ledger. The output folder outlives Redis: a marker whose dataset the ledger does not know means the
  ledger vanished (Redis restarted without persistence, or flushed), and ``submit`` rebuilds it from the
  output files before feeding anything.

Pure file operations: no Redis here.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import uuid
from pathlib import Path
from typing import Final

STORAGE_MARKER: Final = ".tokenfleet-storage"
EPOCH_MARKER: Final = ".tokenfleet-epoch"


def new_token() -> str:
    return secrets.token_hex(16)


def read_marker(path: Path) -> str | None:
    """The token in the marker file ``path``, or None when it is absent, empty or unreadable."""
    try:
        token = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return token or None


def write_marker(path: Path, token: str) -> None:
    """Write ``token`` to ``path`` atomically (a whole file or none: write beside it, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            f.write(token + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def ensure_storage_marker(output_dir: Path) -> str:
    """The token of ``output_dir``'s storage marker, created with a new token when there is none."""
    path = output_dir / STORAGE_MARKER
    token = read_marker(path)
    if token is None:
        token = new_token()
        write_marker(path, token)
    return token


def check_same_storage(output_dir: Path, expected_token: str) -> str | None:
    """Whether ``output_dir`` is the storage submit marked with ``expected_token``: None when it is, else
    the problem in one line."""
    path = output_dir / STORAGE_MARKER
    if not output_dir.is_dir():
        return f"output_dir {output_dir} does not exist here: is the shared storage mounted?"
    token = read_marker(path)
    if token is None:
        return (
            f"{path} is missing: this output_dir is not the storage submit wrote its marker to "
            "(is the shared storage mounted here?)"
        )
    if token != expected_token:
        return (
            f"{path} holds another token than the ledger's: this output_dir is other storage than the one "
            "submit checked (a different disk mounted at the same path?)"
        )
    return None


def probe_writable(folder: Path) -> str | None:
    """Whether files can be created, written and removed in ``folder`` (created if missing): None when
    they can, else the reason in one line."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot create {folder}: {e.strerror or e}"
    probe = folder / f".tokenfleet-probe-{uuid.uuid4().hex[:12]}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, b"probe\n")
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        return f"cannot write in {folder}: {e.strerror or e}"
    finally:
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)
    return None
