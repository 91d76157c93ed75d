"""What export reads from the ledger, stubbed, and a worker's part file: export tests without Redis."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import orjson

from budget import Ledger


class StubLedger:
    """What export reads from the ledger: the spec and the attempt that counted for each sample."""

    def __init__(self, spec: dict[str, Any], done: dict[str, str]) -> None:
        self._spec, self._done = spec, done

    def spec(self, name: str) -> dict[str, Any]:
        return self._spec

    def done_attempts(self, name: str) -> dict[str, str]:
        return dict(self._done)


def stub_ledger(spec: dict[str, Any], done: dict[str, str]) -> Ledger:
    return cast(Ledger, StubLedger(spec, done))


def write_part(folder: Path, records: list[dict[str, Any]]) -> None:
    folder.mkdir(parents=True)
    (folder / "part-host-1.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
