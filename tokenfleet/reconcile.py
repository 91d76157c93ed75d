"""``tokenfleet reconcile``: rebuild a dataset's ledger from its output files, which are the record.

For when Redis lost the ledger (no persistence, a flushed database) or the two disagree. The first whole
record of each sample counts (later ones are second generations of the same sample); torn lines are
skipped; failures come from the failed files. Run it with the fleet stopped: queued and in-flight marks
are cleared, and a following ``submit`` feeds whatever is not done.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import orjson

from budget import Ledger
from tokenfleet.export import iter_part_records
from workers.sink import FAILED_GLOB, PART_GLOB


@dataclass(frozen=True, slots=True)
class ReconcileReport:
    name: str
    samples: int
    tokens: int
    truncated: int
    failed: int
    #: Records of samples already counted by an earlier record (second generations).
    duplicates: int
    torn_lines: int
    #: The ledger's counters before the rebuild.
    samples_before: int
    tokens_before: int
    state: str
    #: Of ``tokens``, the reasoning tokens the records name; samples that ended at ``max_new_tokens``.
    reasoning_tokens: int = 0
    hit_max_new: int = 0


def _failures(dataset_dir: Path) -> dict[str, str]:
    failed: dict[str, str] = {}
    for path in sorted(dataset_dir.glob(FAILED_GLOB)):
        for line in path.read_bytes().splitlines():
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if isinstance(row, dict) and "id" in row:
                failed[str(row["id"])] = str(row.get("reason", ""))
    return failed


def reconcile_dataset(ledger: Ledger, name: str, output_dir: Path) -> ReconcileReport:
    before = ledger.snapshot(name)
    dataset_dir = output_dir / name
    done: dict[str, str] = {}
    tokens = truncated = duplicates = torn = reasoning = hit_max_new = 0
    lengths: list[int] = []
    for record in iter_part_records(dataset_dir):
        if record is None:
            torn += 1
            continue
        sid = str(record["id"])
        if sid in done:
            duplicates += 1
            continue
        done[sid] = str(record.get("attempt", ""))
        completion = int(record.get("completion_tokens") or 0)
        tokens += completion
        lengths.append(completion)
        truncated += int(bool(record.get("truncated")))
        # records written before reasoning tokens were counted have neither field: 0, as then
        reasoning += int(record.get("reasoning_tokens") or 0)
        hit_max_new += int(bool(record.get("hit_max_new")))
    failed = {sid: reason for sid, reason in _failures(dataset_dir).items() if sid not in done}
    state = ledger.rebuild(
        name,
        done,
        tokens,
        truncated,
        failed,
        reasoning_tokens=reasoning,
        hit_max_new=hit_max_new,
        lengths=lengths,
    )
    return ReconcileReport(
        name,
        len(done),
        tokens,
        truncated,
        len(failed),
        duplicates,
        torn,
        before.samples,
        before.tokens,
        state,
        reasoning,
        hit_max_new,
    )


def count_part_lines(dataset_dir: Path) -> int:
    """Lines in a dataset's part files, without parsing them (a cheap check at submit)."""
    total = 0
    for part in dataset_dir.glob(PART_GLOB):
        with part.open("rb") as f:
            while chunk := f.read(1 << 20):
                total += chunk.count(b"\n")
    return total


def disagreement(ledger_samples: int, dataset_dir: Path) -> str | None:
    """Why the ledger and the output files cannot both be right, or None."""
    lines = count_part_lines(dataset_dir)
    if ledger_samples == 0 and lines > 0:
        return (
            f"the ledger counts no sample but {dataset_dir} holds {lines:,} records (was the ledger lost?); "
            "stop and run `tokenfleet reconcile` first, or those samples will be generated again"
        )
    if lines < ledger_samples:
        return (
            f"the ledger counts {ledger_samples:,} samples but {dataset_dir} holds only {lines:,} records "
            "(were output files moved or deleted?)"
        )
    return None
