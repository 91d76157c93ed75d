"""Reading a dataset's JSONL source, streamed line by line.

Each non-blank line is one JSON object: an optional ``id`` (string or integer), the prompt as
``input_ids`` (non-empty list of non-negative integers) or ``text`` (non-empty string), and any other
fields, which are carried along as ``meta``. A bad line never stops the stream: it comes out as a
`Rejected` with a one-line reason. Only a problem with the file as a whole raises `SourceError`.

The file is never loaded whole: a source may hold millions of lines.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import orjson

__all__ = [
    "RAW_PREVIEW_CHARS",
    "Rejected",
    "Sample",
    "SourceError",
    "check_source",
    "derive_sample_id",
    "iter_source",
    "parse_line",
]

#: How much of a rejected line `Rejected.raw` keeps.
RAW_PREVIEW_CHARS: Final = 200

#: Keys of a source line that are not meta.
_ID_KEY: Final = "id"
_INPUT_IDS_KEY: Final = "input_ids"
_TEXT_KEY: Final = "text"

REASON_NOT_OBJECT: Final = "not a JSON object"
REASON_NO_PROMPT: Final = 'no prompt: needs "input_ids" or "text"'
REASON_BAD_INPUT_IDS: Final = '"input_ids" must be a non-empty list of non-negative integers'
REASON_BAD_TEXT: Final = '"text" must be a non-empty string'
REASON_BAD_ID: Final = '"id" must be a string or integer'
REASON_EMPTY_ID: Final = '"id" must not be an empty string'
REASON_BAD_UTF8: Final = "invalid UTF-8"


class SourceError(Exception):
    """A dataset source that cannot be read at all (missing, a directory, unreadable).

    ``str()`` is one line naming the file, e.g. ``data/b2.jsonl: no such file``.
    """

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


@dataclass(slots=True, frozen=True)
class Sample:
    """One prompt of a source. Exactly one of ``input_ids`` and ``text`` is set."""

    sample_id: str
    line_no: int
    input_ids: list[int] | None
    text: str | None
    meta: dict[str, Any]

    def __post_init__(self) -> None:
        if (self.input_ids is None) == (self.text is None):
            raise ValueError("a Sample needs exactly one of input_ids and text")

    def to_task_payload(self) -> dict[str, Any]:
        """A JSON-ready dict: ``sample_id``, ``line_no``, ``input_ids`` or ``text``, ``meta``."""
        payload: dict[str, Any] = {"sample_id": self.sample_id, "line_no": self.line_no}
        if self.input_ids is not None:
            payload["input_ids"] = list(self.input_ids)
        if self.text is not None:
            payload["text"] = self.text
        payload["meta"] = dict(self.meta)
        return payload

    @classmethod
    def from_task_payload(cls, d: Mapping[str, Any]) -> Sample:
        """The inverse of `to_task_payload`; raises ValueError on a malformed payload."""
        sample_id = d.get("sample_id")
        line_no = d.get("line_no")
        input_ids = d.get("input_ids")
        text = d.get("text")
        meta = d.get("meta", {})
        if not isinstance(sample_id, str) or not sample_id:
            raise ValueError("task payload: 'sample_id' must be a non-empty string")
        if type(line_no) is not int or line_no < 1:
            raise ValueError("task payload: 'line_no' must be an integer >= 1")
        if input_ids is not None and not _valid_input_ids(input_ids):
            raise ValueError(f"task payload: {REASON_BAD_INPUT_IDS}")
        if text is not None and (not isinstance(text, str) or not text):
            raise ValueError(f"task payload: {REASON_BAD_TEXT}")
        if (input_ids is None) == (text is None):
            raise ValueError("task payload: needs exactly one of 'input_ids' and 'text'")
        if not isinstance(meta, dict):
            raise ValueError("task payload: 'meta' must be an object")
        return cls(
            sample_id=sample_id,
            line_no=line_no,
            input_ids=list(input_ids) if input_ids is not None else None,
            text=text,
            meta=dict(meta),
        )


@dataclass(slots=True, frozen=True)
class Rejected:
    """A source line that is not a usable sample. ``raw`` keeps at most `RAW_PREVIEW_CHARS` chars."""

    line_no: int
    reason: str
    raw: str

    def __post_init__(self) -> None:
        if len(self.raw) > RAW_PREVIEW_CHARS:
            object.__setattr__(self, "raw", self.raw[:RAW_PREVIEW_CHARS])


def derive_sample_id(obj: Mapping[str, Any]) -> str:
    """The id of a line without one: ``"h"`` + the first 16 hex digits of the sha1 of its canonical JSON.

    Canonical JSON is orjson with sorted keys, so the id depends only on the parsed content (not on key
    order or whitespace) and is the same on every run and machine. Identical lines get identical ids.
    """
    canonical = orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)
    return "h" + hashlib.sha1(canonical).hexdigest()[:16]


def check_source(path: Path) -> None:
    """Raise `SourceError` unless ``path`` is an existing, readable regular file (an empty one is fine).

    Cheap: one stat and one open, nothing is read.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise SourceError(path, "no such file") from None
    except NotADirectoryError:
        raise SourceError(path, "no such file (a parent is not a directory)") from None
    except OSError as exc:
        raise SourceError(path, f"cannot access: {_os_reason(exc)}") from None
    if stat.S_ISDIR(st.st_mode):
        raise SourceError(path, "is a directory, not a file")
    if not stat.S_ISREG(st.st_mode):
        # A FIFO or device would block or could not be re-read on resume.
        raise SourceError(path, "not a regular file")
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise SourceError(path, f"cannot read: {_os_reason(exc)}") from None


def iter_source(path: Path, start_line: int = 1) -> Iterator[Sample | Rejected]:
    """Stream the samples of a JSONL source, one `Sample` or `Rejected` per non-blank line.

    Lines before ``start_line`` (1-based) are skipped unparsed; line numbers always count every line of
    the file, blank ones included. Blank lines yield nothing. Raises `SourceError` (right away, not on
    the first ``next()``) if the file cannot be read; never raises for a bad line.
    """
    if type(start_line) is not int or start_line < 1:
        raise ValueError(f"start_line must be an integer >= 1, got {start_line!r}")
    check_source(path)
    return _iter_lines(path, start_line)


def _iter_lines(path: Path, start_line: int) -> Iterator[Sample | Rejected]:
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed by the with below, errors mapped to SourceError
    except OSError as exc:
        raise SourceError(path, f"cannot read: {_os_reason(exc)}") from None
    with f:
        line_no = 0
        while True:
            try:
                raw = f.readline()
            except OSError as exc:
                raise SourceError(path, f"read failed at line {line_no + 1}: {_os_reason(exc)}") from None
            if not raw:
                return
            line_no += 1
            if line_no < start_line:
                continue
            if line_no == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8) :]
            if not raw or raw.isspace():
                continue
            yield parse_line(raw, line_no)


def parse_line(raw: bytes, line_no: int) -> Sample | Rejected:
    """Parse one source line (with or without its line ending) into a `Sample` or a `Rejected`."""
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

    # null counts as absent for the three known keys: exports of nullable columns write them.
    raw_id = obj.get(_ID_KEY)
    input_ids = obj.get(_INPUT_IDS_KEY)
    text = obj.get(_TEXT_KEY)

    if raw_id is None:
        sample_id = derive_sample_id(obj)
    elif isinstance(raw_id, str):
        if not raw_id:
            return _reject(line_no, REASON_EMPTY_ID, raw)
        sample_id = raw_id
    elif isinstance(raw_id, int) and not isinstance(raw_id, bool):
        sample_id = str(raw_id)
    else:
        return _reject(line_no, REASON_BAD_ID, raw)

    obj.pop(_ID_KEY, None)
    obj.pop(_INPUT_IDS_KEY, None)
    if input_ids is not None:
        if not _valid_input_ids(input_ids):
            return _reject(line_no, REASON_BAD_INPUT_IDS, raw)
        # input_ids wins; a "text" stays in meta untouched.
        if text is None:
            obj.pop(_TEXT_KEY, None)
        return Sample(sample_id=sample_id, line_no=line_no, input_ids=input_ids, text=None, meta=obj)
    if text is not None:
        if not isinstance(text, str) or not text:
            return _reject(line_no, REASON_BAD_TEXT, raw)
        obj.pop(_TEXT_KEY, None)
        return Sample(sample_id=sample_id, line_no=line_no, input_ids=None, text=text, meta=obj)
    return _reject(line_no, REASON_NO_PROMPT, raw)


def _valid_input_ids(value: object) -> bool:
    # set(map(type, ...)) runs in C: bools, floats, strings, nulls and nested values all fail it.
    return isinstance(value, list) and len(value) > 0 and set(map(type, value)) == {int} and min(value) >= 0


def _reject(line_no: int, reason: str, raw: bytes) -> Rejected:
    preview = raw[: RAW_PREVIEW_CHARS * 4].decode("utf-8", errors="replace").rstrip("\r\n")
    return Rejected(line_no=line_no, reason=reason, raw=preview)


def _os_reason(exc: OSError) -> str:
    return exc.strerror or exc.__class__.__name__
