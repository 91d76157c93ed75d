"""Reading a dataset's source, streamed record by record, into `Sample` and `Rejected` items.

The rows come from `producer.containers` (JSON Lines, gzip, Parquet, a saved Hugging Face dataset, other
local data files), each record's shape is read by `producer.formats`, and chat records become exact prompt
tokens through `chat.templates`. A bad record never stops the stream: it comes out as a `Rejected` with its
line (or row) number and a one-line reason. Only a problem with the source as a whole raises `SourceError`.

Without a `RecordReader`, `iter_source` reads tokenfleet's original line format: an optional ``id``
(string or integer), the prompt as ``input_ids`` (non-empty list of non-negative integers) or ``text``
(non-empty string), and any other fields, carried along as ``meta``. A dataset of the config is read with
its own `SourceOptions` (format, id field, tokenizer, regenerate mode, system prompt, context length).

The source is never loaded whole: it may hold millions of records.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import orjson

from budget.defaults import INPUT_ID_CEILING
from chat.templates import REPLY, ChatTokenizer, count_replies, load_chat_tokenizer, plan_conversation
from chat.templates import prompt_messages as _prompt_messages
from producer.containers import MAX_LINE_BYTES, OversizedLine, SourceError, check_source, open_rows
from producer.formats import (
    PLAIN,
    REASON_BAD_INPUT_IDS,
    ROLES,
    derive_sample_id,
    read_record,
    valid_input_ids,
)

__all__ = [
    "RAW_PREVIEW_CHARS",
    "RecordReader",
    "Rejected",
    "Sample",
    "SourceError",
    "SourceOptions",
    "beyond_every_vocabulary",
    "check_source",
    "derive_sample_id",
    "first_record",
    "iter_source",
    "out_of_vocabulary",
    "parse_line",
]

#: How much of a rejected line `Rejected.raw` keeps.
RAW_PREVIEW_CHARS: Final = 200

REASON_NOT_OBJECT: Final = "not a JSON object"
REASON_BAD_TEXT: Final = '"text" must be a non-empty string'
REASON_BAD_UTF8: Final = "invalid UTF-8"
REASON_NEEDS_TOKENIZER: Final = (
    "a chat record needs the target model's tokenizer: set tokenizer = <local folder> for this dataset"
)


@dataclass(slots=True, frozen=True)
class Sample:
    """One prompt of a source. Exactly one of ``input_ids`` and ``text`` is set.

    ``conversation`` (chat and text records of a configured dataset) is the conversation to generate:
    the prompt's turns as ``{"role", "content"}``, each reply to generate as an assistant turn whose
    content is None. The worker generates one reply from ``input_ids`` or ``text``, or several in turn
    (`workers.conversation`) when the conversation holds more than one.
    """

    sample_id: str
    line_no: int
    input_ids: list[int] | None
    text: str | None
    meta: dict[str, Any]
    conversation: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if (self.input_ids is None) == (self.text is None):
            raise ValueError("a Sample needs exactly one of input_ids and text")

    def to_task_payload(self) -> dict[str, Any]:
        """A JSON-ready dict: ``sample_id``, ``line_no``, ``input_ids`` or ``text``, ``meta`` and, when set,
        ``conversation``."""
        payload: dict[str, Any] = {"sample_id": self.sample_id, "line_no": self.line_no}
        if self.input_ids is not None:
            payload["input_ids"] = list(self.input_ids)
        if self.text is not None:
            payload["text"] = self.text
        payload["meta"] = dict(self.meta)
        if self.conversation is not None:
            payload["conversation"] = [dict(t) for t in self.conversation]
        return payload

    @classmethod
    def from_task_payload(cls, d: Mapping[str, Any]) -> Sample:
        """The inverse of `to_task_payload`; raises ValueError on a malformed payload."""
        sample_id = d.get("sample_id")
        line_no = d.get("line_no")
        input_ids = d.get("input_ids")
        text = d.get("text")
        meta = d.get("meta", {})
        conversation = d.get("conversation")
        if not isinstance(sample_id, str) or not sample_id:
            raise ValueError("task payload: 'sample_id' must be a non-empty string")
        if type(line_no) is not int or line_no < 1:
            raise ValueError("task payload: 'line_no' must be an integer >= 1")
        if input_ids is not None and not valid_input_ids(input_ids):
            raise ValueError(f"task payload: {REASON_BAD_INPUT_IDS}")
        if text is not None and (not isinstance(text, str) or not text):
            raise ValueError(f"task payload: {REASON_BAD_TEXT}")
        if (input_ids is None) == (text is None):
            raise ValueError("task payload: needs exactly one of 'input_ids' and 'text'")
        if not isinstance(meta, dict):
            raise ValueError("task payload: 'meta' must be an object")
        if conversation is not None and not _valid_conversation(conversation):
            raise ValueError(
                "task payload: 'conversation' must be a list of {role, content} turns with a reply to fill"
            )
        return cls(
            sample_id=sample_id,
            line_no=line_no,
            input_ids=list(input_ids) if input_ids is not None else None,
            text=text,
            meta=dict(meta),
            conversation=[dict(t) for t in conversation] if conversation is not None else None,
        )


def _valid_conversation(value: object) -> bool:
    if not isinstance(value, list) or not value:
        return False
    for turn in value:
        if not isinstance(turn, dict) or turn.get("role") not in ROLES:
            return False
        content = turn.get("content")
        if not (isinstance(content, str) or (content is None and turn["role"] == "assistant")):
            return False
    return count_replies(value) > 0


@dataclass(slots=True, frozen=True)
class Rejected:
    """A source line that is not a usable sample. ``raw`` keeps at most `RAW_PREVIEW_CHARS` chars."""

    line_no: int
    reason: str
    raw: str

    def __post_init__(self) -> None:
        if len(self.raw) > RAW_PREVIEW_CHARS:
            object.__setattr__(self, "raw", self.raw[:RAW_PREVIEW_CHARS])


@dataclass(frozen=True, slots=True)
class SourceOptions:
    """How one dataset's records are read: the config's per-dataset keys, and what submit learned."""

    format: str = "auto"
    id_field: str = "id"
    regenerate: str = "last"
    system_prompt: str | None = None
    #: A local tokenizer folder (or a model id in the Hugging Face cache); needed for chat records.
    tokenizer: str | None = None
    #: The servers' context length and the dataset's ``max_new_tokens``: a prompt that would not fit is
    #: rejected at submit, with its line, instead of failing on the server.
    context_length: int | None = None
    max_new_tokens: int | None = None
    #: The longest prompt the servers' schedulers take (``max_req_input_len``): a longer one would be
    #: aborted with status 400 after it was queued.
    max_input_len: int | None = None
    #: The model's vocabulary size: an id outside ``[0, vocab_size)`` crashes a real SGLang server (every
    #: process exits), so such a line is rejected here and never sent.
    vocab_size: int | None = None


class RecordReader:
    """Turns rows into samples for one dataset. Loads the tokenizer at once (a `ChatError` then)."""

    def __init__(self, options: SourceOptions | None = None) -> None:
        self.options = options if options is not None else SourceOptions()
        self.fmt = PLAIN if options is None else options.format
        self.chat: ChatTokenizer | None = (
            load_chat_tokenizer(self.options.tokenizer) if self.options.tokenizer else None
        )
        #: Prompts whose ids could not be checked against the vocabulary (unknown): only against
        #: ``INPUT_ID_CEILING``. Submit says how many, and how to have them checked.
        self.unchecked = 0

    def read(self, data: bytes | dict[str, Any] | OversizedLine, line_no: int) -> Sample | Rejected:
        """One row (a raw JSON line, or a decoded row) as a `Sample` or a `Rejected`."""
        if isinstance(data, OversizedLine):
            reason = (
                f"line is {data.size:,} bytes, longer than the {MAX_LINE_BYTES // 2**20} MiB a line may be"
            )
            return Rejected(line_no=line_no, reason=reason, raw="")
        if isinstance(data, bytes):
            parsed = _parse_json(data, line_no)
            if isinstance(parsed, Rejected):
                return parsed
            obj = parsed
        else:
            obj = data
        record = read_record(obj, self.fmt, self.options.id_field)
        if isinstance(record, str):
            return _reject(line_no, record, data)
        if record.input_ids is not None:
            problem = self._out_of_vocabulary(record.input_ids) or self._too_long(len(record.input_ids))
            if problem:
                return _reject(line_no, problem, data)
            return Sample(record.sample_id, line_no, record.input_ids, None, record.meta)
        turns = record.turns
        if record.text is not None:
            if self.fmt == PLAIN:
                return Sample(record.sample_id, line_no, None, record.text, record.meta)
            if self.chat is None:
                conversation = [{"role": "user", "content": record.text}, dict(REPLY)]
                return Sample(record.sample_id, line_no, None, record.text, record.meta, conversation)
            turns = [{"role": "user", "content": record.text}]
        assert turns is not None
        if self.chat is None:
            return _reject(line_no, REASON_NEEDS_TOKENIZER, data)
        planned = plan_conversation(turns, self.options.regenerate, self.options.system_prompt)
        if isinstance(planned, str):
            return _reject(line_no, planned, data)
        try:
            input_ids = self.chat.prompt_ids(_prompt_messages(planned, 0))
        except ValueError as exc:
            return _reject(line_no, str(exc), data)
        problem = self._out_of_vocabulary(input_ids) or self._too_long(len(input_ids))
        if problem:
            return _reject(line_no, problem, data)
        return Sample(record.sample_id, line_no, input_ids, None, record.meta, planned)

    def _out_of_vocabulary(self, input_ids: list[int]) -> str | None:
        vocab = self.options.vocab_size
        if vocab is None:
            problem = beyond_every_vocabulary(input_ids)
            self.unchecked += problem is None
            return problem
        return out_of_vocabulary(input_ids, vocab)

    def _too_long(self, prompt_tokens: int) -> str | None:
        context = self.options.context_length
        if context is not None and prompt_tokens >= context:
            return f"prompt too long: {prompt_tokens} tokens, the servers' context length is {context}"
        wanted = self.options.max_new_tokens or 0
        if context is not None and prompt_tokens + wanted > context:
            return (
                f"prompt too long: {prompt_tokens} tokens + max_new_tokens {wanted} = "
                f"{prompt_tokens + wanted}, over the servers' context length of {context}"
            )
        limit = self.options.max_input_len
        if limit is not None and prompt_tokens > limit:
            return f"prompt too long: {prompt_tokens} tokens, the servers take prompts of at most {limit}"
        return None


def _first_outside(input_ids: list[int], ceiling: int) -> tuple[int, int] | None:
    """The position and value of the first id of ``input_ids`` outside ``[0, ceiling)``, or None."""
    return next(((i, t) for i, t in enumerate(input_ids) if not 0 <= t < ceiling), None)


def out_of_vocabulary(input_ids: list[int], vocab_size: int) -> str | None:
    """The first id of ``input_ids`` outside ``[0, vocab_size)``, described, or None."""
    bad = _first_outside(input_ids, vocab_size)
    if bad is None:
        return None
    return (
        f"input_ids[{bad[0]}] = {bad[1]} is outside the model's vocabulary "
        f"(ids 0 to {vocab_size - 1}); a real SGLang server crashes on it"
    )


def beyond_every_vocabulary(input_ids: list[int]) -> str | None:
    """With the model's vocabulary unknown: the first id of ``input_ids`` no model's vocabulary holds (at
    or above ``INPUT_ID_CEILING``), described, or None."""
    bad = _first_outside(input_ids, INPUT_ID_CEILING)
    if bad is None:
        return None
    return (
        f"input_ids[{bad[0]}] = {bad[1]} is beyond every known model's vocabulary (ids below "
        f"2^31); a real SGLang server crashes on it"
    )


_PLAIN_READER: Final = RecordReader()


def iter_source(
    path: Path, start_line: int = 1, reader: RecordReader | None = None
) -> Iterator[Sample | Rejected]:
    """Stream the samples of a source, one `Sample` or `Rejected` per non-blank line (or row).

    Lines before ``start_line`` (1-based) are skipped unparsed; line numbers always count every line of
    the file, blank ones included. Blank lines yield nothing. Raises `SourceError` (right away, not on
    the first ``next()``) if the source cannot be read; never raises for a bad line. ``reader`` (default:
    the original ``input_ids`` / ``text`` line format) turns records into samples.
    """
    if type(start_line) is not int or start_line < 1:
        raise ValueError(f"start_line must be an integer >= 1, got {start_line!r}")
    rows = open_rows(path, start_line)
    read = (reader or _PLAIN_READER).read
    return (read(data, line_no) for line_no, data in rows)


def first_record(path: Path, fmt: str, id_field: str = "id") -> tuple[int, str] | None:
    """The line number and shape (``messages``, ``text``, ...) of the source's first readable record, or
    None when it has none. Reads only as far as that record."""
    for line_no, data in open_rows(path):
        if isinstance(data, OversizedLine):
            continue
        obj = data if isinstance(data, dict) else _parse_json(data, line_no)
        if isinstance(obj, dict):
            record = read_record(obj, fmt, id_field)
            if not isinstance(record, str):
                return line_no, record.shape
    return None


def parse_line(raw: bytes, line_no: int) -> Sample | Rejected:
    """Parse one source line (with or without its line ending) into a `Sample` or a `Rejected`."""
    return _PLAIN_READER.read(raw, line_no)


def _parse_json(raw: bytes, line_no: int) -> dict[str, Any] | Rejected:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return _reject(line_no, REASON_BAD_UTF8, raw)
        return _reject(line_no, f"invalid JSON: {exc}", raw)
    if not isinstance(obj, dict):
        return _reject(line_no, REASON_NOT_OBJECT, raw)
    return obj


def _reject(line_no: int, reason: str, raw: bytes | dict[str, Any]) -> Rejected:
    data = raw if isinstance(raw, bytes) else orjson.dumps(raw)
    preview = data[: RAW_PREVIEW_CHARS * 4].decode("utf-8", errors="replace").rstrip("\r\n")
    return Rejected(line_no=line_no, reason=reason, raw=preview)
