"""Source containers: JSON Lines (plain and gzip), Parquet, saved Hugging Face datasets, CSV through
``datasets``. Each one yields the same samples, numbered rows, and rejections with their row."""

from __future__ import annotations

import gzip
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from producer.containers import container_of, open_rows
from producer.source import (
    RecordReader,
    Rejected,
    Sample,
    SourceError,
    SourceOptions,
    check_source,
    first_record,
    iter_source,
)

ROWS: list[dict[str, Any]] = [
    {"id": "a", "prompt": "hello there", "n": 1},
    {"id": "b", "prompt": "general kenobi", "n": 2},
    {"id": "c", "prompt": "", "n": 3},
]
CHAT_ROWS: list[dict[str, Any]] = [
    {"id": "m1", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    {"id": "m2", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]},
]


def jsonl_bytes(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in rows)


def read(path: Path, start_line: int = 1) -> list[Sample | Rejected]:
    return list(iter_source(path, start_line, reader=RecordReader(SourceOptions())))


def expected_items() -> list[Sample | Rejected]:
    out: list[Sample | Rejected] = []
    for i, row in enumerate(ROWS[:2], start=1):
        conversation = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": None}]
        out.append(Sample(row["id"], i, None, row["prompt"], {"n": row["n"]}, conversation))
    return out


def assert_same_as_jsonl(items: list[Sample | Rejected]) -> None:
    assert items[:2] == expected_items()
    rejected = items[2]
    assert isinstance(rejected, Rejected)
    assert (rejected.line_no, rejected.reason) == (3, '"prompt" must be a non-empty string')
    assert orjson.loads(rejected.raw) == ROWS[2]


def write_parquet(path: Path, rows: list[dict[str, Any]], row_group_size: int = 2) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def test_jsonl_is_read_line_by_line(tmp_path: Path) -> None:
    src = tmp_path / "d.jsonl"
    src.write_bytes(jsonl_bytes(ROWS))
    assert container_of(src) == "jsonl"
    assert_same_as_jsonl(read(src))


def test_gzip_jsonl_is_told_by_its_bytes_not_its_name(tmp_path: Path) -> None:
    src = tmp_path / "d.data"
    src.write_bytes(gzip.compress(jsonl_bytes(ROWS)))
    assert container_of(src) == "jsonl.gz"
    assert_same_as_jsonl(read(src))


def test_parquet_rows_are_read_as_the_same_samples_with_row_numbers(tmp_path: Path) -> None:
    src = write_parquet(tmp_path / "d.parquet", ROWS)
    assert container_of(src) == "parquet"
    assert_same_as_jsonl(read(src))


def test_parquet_start_line_skips_whole_row_groups_and_keeps_row_numbers(tmp_path: Path) -> None:
    src = write_parquet(tmp_path / "d.parquet", ROWS, row_group_size=2)
    items = read(src, start_line=2)
    assert [i.line_no for i in items] == [2, 3]


def test_nested_chat_columns_survive_parquet(tmp_path: Path) -> None:
    src = write_parquet(tmp_path / "chat.parquet", CHAT_ROWS)
    rows = [data for _, data in open_rows(src)]
    assert rows == CHAT_ROWS
    assert first_record(src, "auto") == (1, "messages")


def test_a_saved_hugging_face_dataset_folder_is_a_source(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(folder))
    check_source(folder)
    assert container_of(folder) == "saved_dataset"
    assert_same_as_jsonl(read(folder))


def test_a_saved_dataset_dict_is_read_through_its_train_split(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "saved"
    splits = {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:1])}
    datasets.DatasetDict(splits).save_to_disk(str(folder))
    assert_same_as_jsonl(read(folder))


def test_a_saved_dataset_dict_without_a_train_split_names_its_splits(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "saved"
    splits = {"a": datasets.Dataset.from_list(ROWS), "b": datasets.Dataset.from_list(ROWS)}
    datasets.DatasetDict(splits).save_to_disk(str(folder))
    with pytest.raises(SourceError) as info:
        read(folder)
    assert str(info.value) == (
        f"{folder}: a DatasetDict with splits a, b and no 'train': point path at one split's folder "
        f"(e.g. {folder / 'a'})"
    )


def test_csv_data_files_are_streamed_through_datasets(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    src = tmp_path / "d.csv"
    src.write_text("id,prompt,n\na,hello there,1\nb,general kenobi,2\n")
    assert container_of(src) == "datasets:csv"
    assert read(src) == expected_items()


def test_a_folder_that_is_not_a_saved_dataset_is_still_not_a_source(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").write_bytes(jsonl_bytes(ROWS))
    with pytest.raises(SourceError) as info:
        check_source(tmp_path)
    assert str(info.value) == f"{tmp_path}: is a directory, not a file"


@pytest.mark.parametrize("text", ['[\n  {"text": "x"}\n]\n', '[{"text": "x"}, {"text": "y"}]\n'])
def test_a_json_array_file_is_refused_with_a_hint_to_convert_it(tmp_path: Path, text: str) -> None:
    src = tmp_path / "d.json"
    src.write_text(text)
    with pytest.raises(SourceError, match=r"holds a JSON array, not JSON Lines: .*jq -c"):
        read(src)


def test_a_corrupt_parquet_file_is_one_source_error(tmp_path: Path) -> None:
    src = tmp_path / "d.parquet"
    src.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(SourceError) as info:
        read(src)
    assert str(info.value).startswith(f"{src}: not a readable Parquet file: ")


def test_reading_plain_jsonl_imports_no_tokenizer_or_arrow_library(tmp_path: Path) -> None:
    src = tmp_path / "d.jsonl"
    src.write_bytes(jsonl_bytes(ROWS[:2]) + orjson.dumps({"input_ids": [1, 2]}) + b"\n")
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "import producer.feeder, tokenfleet.submit, tokenfleet.export, workers.runner\n"
        "from producer.source import RecordReader, SourceOptions, iter_source\n"
        f"items = list(iter_source(Path({str(src)!r}), reader=RecordReader(SourceOptions())))\n"
        "assert len(items) == 3, items\n"
        "heavy = ('transformers', 'tokenizers', 'jinja2', 'datasets', 'pyarrow')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
