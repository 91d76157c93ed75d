"""``tokenfleet export``: one JSONL file holding each committed sample once, in the shape a trainer loads.

The part files may hold more than one record per sample (a generation that ran twice, a worker killed
between writing and committing); the ledger's done hash names the attempt that counted, and only that
record is exported.

Formats (``docs/eagle3.md``):

- ``tokens`` (default): the full record, plus ``loss_mask`` over ``input_ids + output_ids`` (1 on generated
  tokens: the output, and each earlier reply of a conversation that stands verbatim in the last prompt).
  Every committed sample is written, truncated ones marked, so the export's tokens equal the ledger's.
- ``specforge``: ``{"id", "conversations": [{"role", "content"}, ...]}``, what SpecForge's training data
  loader reads (``load_dataset("json")``, then a ``conversations`` column).
- ``sharegpt``: ``{"id", "conversations": [{"from": "system" | "human" | "gpt", "value"}, ...]}``.

In ``specforge`` and ``sharegpt`` a reply's text is its exact ``output_ids`` decoded with the dataset's
tokenizer (without special tokens and the stop token), the same text the trainer tokenizes again with that
tokenizer; a dataset without a tokenizer uses the server's ``text``. Replies of a conversation of several
replies were decoded by the worker, which used that text as the next prompt's history. Truncated samples
are left out unless ``include_truncated``; samples without a conversation (pre-tokenized ``input_ids``
prompts) cannot be written as one and are counted as skipped.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, get_args

import orjson

from budget import Ledger
from producer.chat import ChatError, load_chat_tokenizer
from workers.sink import PART_GLOB

__all__ = [
    "EXPORT_FORMATS",
    "ExportError",
    "ExportFormat",
    "ExportReport",
    "export_dataset",
    "iter_part_records",
    "loss_mask",
    "reply_conversation",
]

ExportFormat = Literal["tokens", "specforge", "sharegpt"]
EXPORT_FORMATS: Final[tuple[str, ...]] = get_args(ExportFormat)

#: ShareGPT's name for each role.
SHAREGPT_FROM: Final[Mapping[str, str]] = {"system": "system", "user": "human", "assistant": "gpt"}

#: Decodes one reply's output ids (with its finish reason) to its text.
Decode = Callable[[Sequence[int], Mapping[str, Any] | None], str]


class ExportError(Exception):
    """An export that cannot be written as asked (one user-facing line)."""


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
    format: str = "tokens"
    #: Committed samples left out of a ``specforge`` / ``sharegpt`` export: truncated ones (without
    #: ``include_truncated``), and those with no conversation to write (pre-tokenized prompts).
    skipped_truncated: int = 0
    skipped_no_conversation: int = 0


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


def loss_mask(record: Mapping[str, Any]) -> list[int]:
    """1 on generated tokens of ``input_ids + output_ids``: the output, and each earlier reply of a
    conversation that stands verbatim at its place in the last prompt (``in_context``). A record without
    ``input_ids`` (a text prompt the server tokenized) has a mask over its output only."""
    prompt = record.get("input_ids") or []
    mask = [0] * len(prompt) + [1] * len(record.get("output_ids") or [])
    for turn in (record.get("turns") or [])[:-1]:
        if turn.get("in_context"):
            start = int(turn["prompt_tokens"])
            mask[start : start + len(turn["output_ids"])] = [1] * len(turn["output_ids"])
    return mask


def reply_conversation(record: Mapping[str, Any], decode: Decode | None) -> list[dict[str, str]] | None:
    """The record's conversation with each generated reply filled in, ending after the last reply it has
    (a conversation cut by the budget, or ended early, has fewer); None when the record has none."""
    conversation = record.get("conversation")
    if not conversation:
        return None
    turns = record.get("turns")
    if turns:
        replies = [str(t.get("content") or "") for t in turns]
    elif decode is not None and record.get("output_ids") is not None:
        replies = [decode(record["output_ids"], record.get("finish_reason"))]
    else:
        replies = [str(record.get("text") or "")]
    out: list[dict[str, str]] = []
    filled = end = 0
    for turn in conversation:
        if turn.get("role") == "assistant" and turn.get("content") is None:
            if filled == len(replies):
                break
            out.append({"role": "assistant", "content": replies[filled]})
            filled += 1
            end = len(out)
        else:
            out.append({"role": str(turn["role"]), "content": str(turn["content"])})
    return out[:end] if filled else None


def _row(fmt: str, record: Mapping[str, Any], conversation: list[dict[str, str]]) -> dict[str, Any]:
    if fmt == "specforge":
        return {"id": str(record["id"]), "conversations": conversation}
    return {
        "id": str(record["id"]),
        "conversations": [{"from": SHAREGPT_FROM[t["role"]], "value": t["content"]} for t in conversation],
    }


def export_dataset(
    ledger: Ledger,
    name: str,
    out: Path,
    output_dir: Path | None = None,
    *,
    format: str = "tokens",
    include_truncated: bool = False,
) -> ExportReport:
    """Write ``name``'s committed records to ``out`` (atomically: a temp file renamed at the end)."""
    if format not in EXPORT_FORMATS:
        raise ExportError(f"unknown export format {format!r} (choose from {', '.join(EXPORT_FORMATS)})")
    spec = ledger.spec(name) if output_dir is None or format != "tokens" else {}
    root = output_dir if output_dir is not None else Path(spec["output_dir"])
    decode = _decoder(name, spec.get("tokenizer")) if format != "tokens" else None
    wanted = ledger.done_attempts(name)
    records = tokens = superseded = torn = skipped_truncated = skipped_no_conversation = 0
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
                if format == "tokens":
                    row: dict[str, Any] = {**record, "loss_mask": loss_mask(record)}
                elif record.get("truncated") and not include_truncated:
                    skipped_truncated += 1
                    continue
                else:
                    conversation = reply_conversation(record, decode)
                    if conversation is None:
                        skipped_no_conversation += 1
                        continue
                    row = _row(format, record, conversation)
                f.write(orjson.dumps(row) + b"\n")
                records += 1
                tokens += int(record.get("completion_tokens") or 0)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return ExportReport(
        out,
        records,
        tokens,
        superseded,
        torn,
        missing=len(wanted),
        format=format,
        skipped_truncated=skipped_truncated,
        skipped_no_conversation=skipped_no_conversation,
    )


def _decoder(name: str, tokenizer: str | None) -> Decode | None:
    """The dataset's tokenizer's reply decoding, or None (then the server's text is used)."""
    if not tokenizer:
        return None
    try:
        return load_chat_tokenizer(tokenizer).reply_text
    except ChatError as e:
        raise ExportError(
            f"dataset {name!r}: {e} (conversations are decoded with the dataset's tokenizer; "
            "--format tokens needs none)"
        ) from None
