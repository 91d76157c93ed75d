"""``tokenfleet export``: one JSONL file holding each committed sample once.

The part files may hold more than one record per sample (a generation that ran twice, a worker killed
between writing and committing); the ledger's done hash names the attempt that counted, and only that
record is exported, so the export's tokens equal the ledger's.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from budget import Ledger
from workers.sink import PART_GLOB


@dataclass(frozen=True, slots=True)
class ExportReport:
    path: Path
    records: int
    tokens: int
    #: Records of attempts the ledger did not count (second generations, uncommitted writes).
    superseded: int
    #: Lines that are not whole JSON records (a torn last line after a crash).
    torn_lines: int
    #: Samples the ledger counts whose record is missing from the part files.
    missing: int


def iter_part_records(dataset_dir: Path) -> Iterator[dict[str, Any] | None]:
    """Every record of every part file; ``None`` for a line that is not a whole record."""
    for part in sorted(dataset_dir.glob(PART_GLOB)):
        with part.open("rb") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    record = orjson.loads(line)
                except orjson.JSONDecodeError:
                    yield None
                    continue
                yield record if isinstance(record, dict) and "id" in record else None


def export_dataset(ledger: Ledger, name: str, out: Path, output_dir: Path | None = None) -> ExportReport:
    """Write ``name``'s committed records to ``out`` (atomically: a temp file renamed at the end)."""
    root = output_dir if output_dir is not None else Path(ledger.spec(name)["output_dir"])
    wanted = ledger.done_attempts(name)
    records = tokens = superseded = torn = 0
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as f:
            for record in iter_part_records(root / name):
                if record is None:
                    torn += 1
                    continue
                sid = str(record["id"])
                if wanted.get(sid) != record.get("attempt"):
                    superseded += 1
                    continue
                del wanted[sid]
                f.write(orjson.dumps(record) + b"\n")
                records += 1
                tokens += int(record.get("completion_tokens") or 0)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return ExportReport(out, records, tokens, superseded, torn, missing=len(wanted))
