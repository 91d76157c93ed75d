"""The files a dataset source can be: where rows come from, streamed, never loaded whole.

- **JSON Lines**, plain or gzip-compressed (told by the file's first bytes, not its name): one JSON object
  per line. Rows are the raw lines, so a bad line can be rejected with its line number and the rest goes on.
- **Parquet** (told by its ``PAR1`` magic): read one row group at a time with pyarrow, so memory is bounded
  by the largest row group, not the file.
- **A Hugging Face dataset saved on disk** (a folder written by ``save_to_disk``): opened with
  ``datasets.load_from_disk``, which memory-maps its Arrow files; a ``DatasetDict`` folder is read through
  its only split or its ``train`` split.
- **Other local data files** the ``datasets`` library reads (``.csv``, ``.tsv``, ``.arrow``): streamed with
  ``datasets.load_dataset(builder, data_files=..., streaming=True)``.

Rows of Parquet and ``datasets`` sources are numbered from 1 like lines, and turned into plain JSON values
(bytes, decimals and dates become strings) so that ids derived from content and task payloads behave the
same as for JSON Lines. pyarrow and datasets are imported only when such a source is read.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import gzip
import io
import os
import stat
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final, NamedTuple

import orjson

__all__ = [
    "DATASETS_SUFFIXES",
    "MAX_LINE_BYTES",
    "ROWS_PER_BATCH",
    "OversizedLine",
    "Row",
    "SourceError",
    "check_source",
    "container_of",
    "open_rows",
]

#: Rows read from a columnar source at a time.
ROWS_PER_BATCH: Final = 1024
#: Files whose first bytes say gzip or Parquet.
_GZIP_MAGIC: Final = b"\x1f\x8b"
_PARQUET_MAGIC: Final = b"PAR1"
#: Suffixes read through a ``datasets`` builder, and which one.
DATASETS_SUFFIXES: Final = {".csv": "csv", ".tsv": "csv", ".arrow": "arrow"}
#: Files ``save_to_disk`` writes into a dataset folder (a ``Dataset``, a ``DatasetDict``).
_SAVED_DATASET_FILES: Final = ("state.json", "dataset_dict.json")
#: The split read from a saved ``DatasetDict`` with several.
DEFAULT_SPLIT: Final = "train"

#: One row of a source: its 1-based line (or row) number and either the raw line or the decoded row.
#: A source line is not read past this many bytes: a longer one is rejected, not loaded into memory.
MAX_LINE_BYTES: Final = 16 * 2**20


class OversizedLine(NamedTuple):
    """A line longer than ``MAX_LINE_BYTES``: skipped unread (its size is all that is known)."""

    size: int


Row = tuple[int, bytes | dict[str, Any] | OversizedLine]


class SourceError(Exception):
    """A dataset source that cannot be read at all (missing, a directory, unreadable).

    ``str()`` is one line naming the file, e.g. ``data/b2.jsonl: no such file``.
    """

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


def _os_reason(exc: OSError) -> str:
    return exc.strerror or exc.__class__.__name__


def _is_saved_dataset(path: Path) -> bool:
    return any((path / name).is_file() for name in _SAVED_DATASET_FILES)


def check_source(path: Path) -> None:
    """Raise `SourceError` unless ``path`` is a readable regular file (an empty one is fine) or a folder
    holding a dataset saved with ``save_to_disk``.

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
        if _is_saved_dataset(path):
            return
        raise SourceError(path, "is a directory, not a file")
    if not stat.S_ISREG(st.st_mode):
        # A FIFO or device would block or could not be re-read on resume.
        raise SourceError(path, "not a regular file")
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise SourceError(path, f"cannot read: {_os_reason(exc)}") from None


def container_of(path: Path) -> str:
    """``jsonl``, ``jsonl.gz``, ``parquet``, ``saved_dataset`` or ``datasets:<builder>``."""
    if path.is_dir():
        return "saved_dataset"
    builder = DATASETS_SUFFIXES.get(path.suffix.lower())
    if builder is not None:
        return f"datasets:{builder}"
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as exc:
        raise SourceError(path, f"cannot read: {_os_reason(exc)}") from None
    if head.startswith(_GZIP_MAGIC):
        return "jsonl.gz"
    if head == _PARQUET_MAGIC:
        return "parquet"
    return "jsonl"


def open_rows(path: Path, start_line: int = 1) -> Iterator[Row]:
    """The rows of the source at ``path`` from ``start_line`` on (1-based; earlier rows are skipped unread
    where the container allows it). Opens the source now: a source that cannot be read raises `SourceError`
    here, not on the first ``next()``. Blank JSON lines yield nothing but are counted."""
    check_source(path)
    kind = container_of(path)
    if kind in ("jsonl", "jsonl.gz"):
        try:
            f: io.BufferedIOBase = gzip.open(path, "rb") if kind == "jsonl.gz" else open(path, "rb")  # noqa: SIM115
        except OSError as exc:
            raise SourceError(path, f"cannot read: {_os_reason(exc)}") from None
        return _jsonl_rows(path, f, start_line)
    if kind == "parquet":
        return _parquet_rows(path, start_line)
    if kind == "saved_dataset":
        return _dataset_rows(path, _load_saved_dataset(path), start_line)
    builder = kind.split(":", 1)[1]
    return _dataset_rows(path, _stream_data_files(path, builder), start_line)


# --- JSON Lines ----------------------------------------------------------------------------------------


def _jsonl_rows(path: Path, f: io.BufferedIOBase, start_line: int) -> Iterator[Row]:
    with f:
        line_no = 0
        while True:
            try:
                raw = f.readline(MAX_LINE_BYTES + 1)
                oversized = len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n")
                size = len(raw)
                while oversized and raw and not raw.endswith(b"\n"):  # skip the rest, a chunk at a time
                    raw = f.readline(1 << 20)
                    size += len(raw)
            except (OSError, EOFError, zlib.error) as exc:
                reason = _os_reason(exc) if isinstance(exc, OSError) else str(exc) or type(exc).__name__
                raise SourceError(path, f"read failed at line {line_no + 1}: {reason}") from None
            if not raw and not oversized:
                return
            line_no += 1
            if line_no < start_line:
                continue
            if oversized:
                yield line_no, OversizedLine(size)
                continue
            if line_no == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            if not raw or raw.isspace():
                continue
            if line_no == 1 and _opens_json_array(raw):
                raise SourceError(
                    path,
                    "holds a JSON array, not JSON Lines: write one object per line "
                    "(for example with `jq -c '.[]'`), so it can be streamed",
                )
            yield line_no, raw


def _opens_json_array(first_line: bytes) -> bool:
    """A pretty-printed JSON array (``[`` alone) or a one-line array of objects: not JSON Lines."""
    stripped = first_line.strip()
    return stripped == b"[" or stripped.startswith(b"[{")


# --- columnar sources ----------------------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    """orjson's fallback for values Arrow hands back that JSON has no type for."""
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return base64.b64encode(raw).decode("ascii")
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if hasattr(value, "tolist"):  # numpy arrays and scalars from datasets
        return value.tolist()
    return str(value)


def to_json_row(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` as plain JSON values (what the same row would be in a JSON Lines file)."""
    data: dict[str, Any] = orjson.loads(
        orjson.dumps(row, default=_jsonable, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY)
    )
    return data


def _parquet_rows(path: Path, start_line: int) -> Iterator[Row]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        raise SourceError(path, f"not a readable Parquet file: {exc}") from None
    return _parquet_batches(path, pf, start_line)


def _parquet_batches(path: Path, pf: Any, start_line: int) -> Iterator[Row]:
    import pyarrow as pa

    row_no = 0
    try:
        # One row group at a time: skipped groups are never decoded.
        for group in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(group).num_rows
            if row_no + n < start_line:
                row_no += n
                continue
            for batch in pf.iter_batches(batch_size=ROWS_PER_BATCH, row_groups=[group]):
                for row in batch.to_pylist():
                    row_no += 1
                    if row_no >= start_line:
                        yield row_no, to_json_row(row)
    except (OSError, pa.ArrowException) as exc:
        raise SourceError(path, f"read failed after row {row_no}: {exc}") from None
    finally:
        pf.close()


def _load_saved_dataset(path: Path) -> Any:
    try:
        import datasets
    except ImportError:
        raise SourceError(path, _missing_extra("datasets")) from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises many types for a broken folder
        raise SourceError(path, f"not a readable saved dataset: {exc}") from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if len(splits) == 1:
            return loaded[splits[0]]
        if DEFAULT_SPLIT in loaded:
            return loaded[DEFAULT_SPLIT]
        raise SourceError(
            path,
            f"a DatasetDict with splits {', '.join(splits)} and no {DEFAULT_SPLIT!r}: "
            f"point path at one split's folder (e.g. {path / splits[0]})",
        )
    return loaded


def _stream_data_files(path: Path, builder: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise SourceError(path, _missing_extra("datasets")) from None
    kwargs: dict[str, Any] = {"delimiter": "\t"} if path.suffix.lower() == ".tsv" else {}
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True, **kwargs)
    except Exception as exc:
        raise SourceError(path, f"cannot read with datasets ({builder}): {exc}") from None


def _dataset_rows(path: Path, ds: Any, start_line: int) -> Iterator[Row]:
    row_no = 0
    try:
        for batch in ds.iter(batch_size=ROWS_PER_BATCH):
            columns = list(batch)
            n = len(batch[columns[0]]) if columns else 0
            for i in range(n):
                row_no += 1
                if row_no >= start_line:
                    yield row_no, to_json_row({c: batch[c][i] for c in columns})
    except SourceError:
        raise
    except Exception as exc:
        raise SourceError(path, f"read failed after row {row_no}: {exc}") from None


def _missing_extra(module: str) -> str:
    return f"reading it needs the {module!r} package: pip install 'tokenfleet[eagle]'"
