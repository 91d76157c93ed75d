"""``tokenfleet export``: one JSONL file holding each committed sample once, in the shape a trainer loads.

The part files may hold more than one record per sample (a generation that ran twice, a worker killed
between writing and committing); the ledger's done hash names the attempt that counted, and only that
record is exported.

Formats (``docs/eagle3.md``):

- ``tokens`` (default): the full record (``input_ids`` is the prompt, ``output_ids`` the output), plus
  ``generated_mask`` over ``input_ids + output_ids`` (1 on generated tokens). Every committed sample is
  written, truncated ones marked, so the export's tokens equal the ledger's. It holds no ``loss_mask``: a
  trainer that finds ``input_ids`` and ``loss_mask`` takes ``input_ids`` for the whole sequence. Its
  ``reasoning_tokens`` is how many of ``completion_tokens`` the model spent thinking (0 in records written
  before it was counted).
- ``specforge-tokens``: ``{"id", "input_ids", "loss_mask"}``, the whole sequence as exact ids, what SpecForge
  loads as pre-tokenized data (`tokenfleet.exports.token_rows`).
- ``speculators``: vllm-project/speculators' regeneration rows, one per reply, with the reply's
  ``reasoning_tokens`` in its ``metadata`` (`tokenfleet.exports.token_rows`).
- ``specforge``: ``{"id", "conversations": [{"role", "content"}, ...]}``, what SpecForge's raw-data loader
  reads (``load_dataset("json")``, then a ``conversations`` column).
- ``sharegpt``: ``{"id", "conversations": [{"from": "system" | "human" | "gpt", "value"}, ...]}``.

In ``specforge`` and ``sharegpt`` a reply's text is its exact ``output_ids`` decoded with the dataset's
tokenizer (without special tokens and the stop token), the same text the trainer tokenizes again with that
tokenizer; a dataset without a tokenizer uses the server's ``text``. Replies of a conversation of several
replies were decoded by the worker, which used that text as the next prompt's history. Each reply is
rendered and tokenized again as the trainer will, and those whose tokens are not the generated ones are
counted (`tokenfleet.exports.retokenize`). A row starts with the system turn the prompt was made with.
Truncated samples are left out of every format but ``tokens`` unless ``include_truncated``; samples without
a conversation (pre-tokenized ``input_ids`` prompts) cannot be written as one and are counted as skipped.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, get_args

import orjson

from budget import DatasetSnapshot, DatasetState, Ledger
from chat.templates import ChatError, ChatTokenizer, load_chat_tokenizer
from tokenfleet.exports.retokenize import ChatRenderer, Mismatch, check_row, replies_of
from tokenfleet.exports.token_rows import loss_mask, specforge_tokens_row, speculators_rows
from tokenfleet.status_view import unfed
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
    "unsettled_warning",
]

ExportFormat = Literal["tokens", "specforge-tokens", "speculators", "specforge", "sharegpt"]
EXPORT_FORMATS: Final[tuple[str, ...]] = get_args(ExportFormat)
#: Formats of conversation text, which the trainer tokenizes again.
TEXT_FORMATS: Final = frozenset({"specforge", "sharegpt"})
#: Formats of exact ids over the whole sequence, with a loss mask.
TOKEN_FORMATS: Final = frozenset({"specforge-tokens", "speculators"})
#: How many mismatching replies the report names (all of them go to the side file).
MISMATCH_EXAMPLES: Final = 20

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
    #: Committed samples left out of a format other than ``tokens``: truncated ones (without
    #: ``include_truncated``), those with no conversation to write (pre-tokenized prompts, text formats),
    #: those whose prompt ids are not known (text prompts the server tokenized, token formats), and those
    #: with no generated token (a trainer drops a row with nothing to learn).
    skipped_truncated: int = 0
    skipped_no_conversation: int = 0
    skipped_no_prompt_ids: int = 0
    skipped_empty: int = 0
    #: ``speculators``: earlier replies of a conversation whose exact prompt is not on record.
    replies_left_out: int = 0
    #: Text formats: replies rendered and tokenized again as the trainer will (0: no tokenizer to check
    #: with), and those whose tokens are not the generated ones (``mismatch_examples`` names the first ones,
    #: ``mismatch_path`` holds them all).
    replies_checked: int = 0
    mismatches: int = 0
    mismatch_examples: tuple[Mismatch, ...] = field(default=())
    mismatch_path: Path | None = None
    #: Text formats: rows written without a system turn (the prompt had none, and the template renders an
    #: empty one differently): a trainer may add its own default system prompt to them.
    no_system_turn: int = 0
    #: Of ``tokens``, those the model spent thinking (the records' ``reasoning_tokens``).
    reasoning_tokens: int = 0
    #: Samples the ledger counted as committed when the export read it: what the export is made of.
    committed: int = 0


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


def with_system_turn(conversation: list[dict[str, str]], chat: ChatRenderer | None) -> list[dict[str, str]]:
    """The conversation starting with the system turn its prompt was made with.

    A record's conversation holds its own system turn or the dataset's ``system_prompt``. One without: a
    trainer that finds no system turn may add its template's default (SpecForge does), a prompt the model
    never saw; an empty system turn stops that, and is written when the template renders it exactly as no
    system turn. Otherwise the row stays without one (the caller counts it)."""
    if conversation[0]["role"] == "system" or chat is None:
        return conversation
    first = next((i for i, t in enumerate(conversation) if t["role"] == "assistant"), len(conversation))
    empty = [{"role": "system", "content": ""}, *conversation]
    try:
        same = chat.render(empty[: first + 1]) == chat.render(conversation[:first])
    except Exception:  # a template that refuses a system turn: leave the row as it is
        same = False
    return empty if same else conversation


def _row(fmt: str, record: Mapping[str, Any], conversation: list[dict[str, str]]) -> dict[str, Any]:
    if fmt == "specforge":
        return {"id": str(record["id"]), "conversations": conversation}
    return {
        "id": str(record["id"]),
        "conversations": [{"from": SHAREGPT_FROM[t["role"]], "value": t["content"]} for t in conversation],
    }


@dataclass
class _Counts:
    records: int = 0
    tokens: int = 0
    reasoning_tokens: int = 0
    superseded: int = 0
    torn: int = 0
    skipped_truncated: int = 0
    skipped_no_conversation: int = 0
    skipped_no_prompt_ids: int = 0
    skipped_empty: int = 0
    replies_left_out: int = 0
    replies_checked: int = 0
    no_system_turn: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)


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
    spec = ledger.spec(name) if output_dir is None or format in TEXT_FORMATS else {}
    root = output_dir if output_dir is not None else Path(spec["output_dir"])
    chat = _chat(name, spec.get("tokenizer")) if format in TEXT_FORMATS else None
    wanted = ledger.done_attempts(name)
    committed = len(wanted)
    c = _Counts()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as f:
            for record in iter_part_records(root / name):
                if record is None:
                    c.torn += 1
                    continue
                sid = str(record["id"])
                if wanted.get(sid) != record.get("attempt"):
                    c.superseded += 1
                    continue
                del wanted[sid]
                rows = _rows(format, record, chat, include_truncated, c)
                if not rows:
                    continue
                f.write(b"".join(orjson.dumps(row) + b"\n" for row in rows))
                c.records += 1
                c.tokens += int(record.get("completion_tokens") or 0)
                c.reasoning_tokens += int(record.get("reasoning_tokens") or 0)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    mismatch_path = _write_mismatches(out, c.mismatches) if format in TEXT_FORMATS else None
    return ExportReport(
        out,
        c.records,
        c.tokens,
        c.superseded,
        c.torn,
        missing=len(wanted),
        format=format,
        skipped_truncated=c.skipped_truncated,
        skipped_no_conversation=c.skipped_no_conversation,
        skipped_no_prompt_ids=c.skipped_no_prompt_ids,
        skipped_empty=c.skipped_empty,
        replies_left_out=c.replies_left_out,
        replies_checked=c.replies_checked,
        mismatches=len(c.mismatches),
        mismatch_examples=tuple(c.mismatches[:MISMATCH_EXAMPLES]),
        mismatch_path=mismatch_path,
        no_system_turn=c.no_system_turn,
        reasoning_tokens=c.reasoning_tokens,
        committed=committed,
    )


def unsettled_warning(s: DatasetSnapshot, committed: int) -> str | None:
    """One line when ``s`` (read before the export) is not settled: samples may still be committed after
    the export read the ledger, which holds the ``committed`` ones only. None once it is settled."""
    if s.settled:
        return None
    if s.state == DatasetState.ACTIVE:
        doing = "is still running"
    elif s.state == DatasetState.PAUSED:
        doing = "is paused"
    else:  # exhausted or revoked, with generations still queued or running
        doing = f"is {s.state} and still finishing"
    left = [f"{s.queued:,} queued", f"{s.inflight:,} in flight"]
    if s.pending:
        left.append(f"{s.pending:,} to feed again")
    if s.state in (DatasetState.ACTIVE, DatasetState.PAUSED):  # its source is fed on (after a resume)
        unsent = unfed(s)
        if unsent is None:
            left.append("its source not all read yet")
        elif unsent:
            left.append(f"{unsent:,} not sent yet")
    return (
        f"{s.name} {doing} ({', '.join(left)}): this export holds the {committed:,} samples committed so far"
    )


def _rows(
    fmt: str, record: dict[str, Any], chat: ChatTokenizer | None, include_truncated: bool, c: _Counts
) -> list[dict[str, Any]]:
    """The rows one committed record becomes (none when it is left out, counted in ``c``)."""
    if fmt == "tokens":
        reasoning = int(record.get("reasoning_tokens") or 0)
        return [{**record, "reasoning_tokens": reasoning, "generated_mask": loss_mask(record)}]
    if record.get("truncated") and not include_truncated:
        c.skipped_truncated += 1
        return []
    if fmt in TOKEN_FORMATS:
        if record.get("input_ids") is None:
            c.skipped_no_prompt_ids += 1
            return []
        if not record.get("output_ids"):
            c.skipped_empty += 1
            return []
        if fmt == "specforge-tokens":
            row = specforge_tokens_row(record)
            return [row] if row is not None else []
        conversation = reply_conversation(record, chat.reply_text if chat else None)
        rows, left_out = speculators_rows(record, conversation)
        c.replies_left_out += left_out
        return rows
    conversation = reply_conversation(record, chat.reply_text if chat else None)
    if conversation is None:
        c.skipped_no_conversation += 1
        return []
    conversation = with_system_turn(conversation, chat)
    if conversation[0]["role"] != "system":
        c.no_system_turn += 1
    if chat is not None:
        replies = replies_of(record)
        c.replies_checked += min(len(replies), sum(1 for t in conversation if t["role"] == "assistant"))
        c.mismatches.extend(check_row(chat, str(record["id"]), conversation, replies))
    return [_row(fmt, record, conversation)]


def _write_mismatches(out: Path, mismatches: list[Mismatch]) -> Path | None:
    """Every reply that does not re-tokenize to its ids, beside the export (none: no file, an old one
    removed)."""
    path = out.with_name(f"{out.name}.mismatches.jsonl")
    if not mismatches:
        path.unlink(missing_ok=True)
        return None
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(
            b"".join(
                orjson.dumps({"id": m.id, "reply": m.reply, "where": m.where, "token": m.token}) + b"\n"
                for m in mismatches
            )
        )
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _chat(name: str, tokenizer: str | None) -> ChatTokenizer | None:
    """The dataset's tokenizer, or None (then the server's text is used, and nothing is checked)."""
    if not tokenizer:
        return None
    try:
        return load_chat_tokenizer(tokenizer)
    except ChatError as e:
        raise ExportError(
            f"dataset {name!r}: {e} (conversations are decoded with the dataset's tokenizer; "
            "--format tokens needs none)"
        ) from None
