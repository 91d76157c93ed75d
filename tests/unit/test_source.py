from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import orjson
import pytest

from producer.source import (
    RAW_PREVIEW_CHARS,
    RecordReader,
    Rejected,
    Sample,
    SourceError,
    SourceOptions,
    check_source,
    derive_sample_id,
    iter_source,
)


def write_lines(path: Path, *lines: str | bytes, newline: bytes = b"\n") -> Path:
    data = newline.join(line if isinstance(line, bytes) else line.encode() for line in lines) + newline
    path.write_bytes(data)
    return path


def read_all(path: Path, start_line: int = 1) -> list[Sample | Rejected]:
    return list(iter_source(path, start_line))


def only(items: list[Sample | Rejected]) -> Sample | Rejected:
    assert len(items) == 1
    return items[0]


def test_text_and_input_ids_lines_become_samples(tmp_path: Path) -> None:
    src = write_lines(
        tmp_path / "s.jsonl",
        '{"id": "a", "text": "hello"}',
        '{"id": "b", "input_ids": [1, 2, 0]}',
    )
    assert read_all(src) == [
        Sample(sample_id="a", line_no=1, input_ids=None, text="hello", meta={}),
        Sample(sample_id="b", line_no=2, input_ids=[1, 2, 0], text=None, meta={}),
    ]


def test_integer_id_is_turned_into_a_string(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "s.jsonl", '{"id": 123, "text": "x"}')
    sample = only(read_all(src))
    assert isinstance(sample, Sample)
    assert sample.sample_id == "123"


def test_every_other_field_goes_to_meta(tmp_path: Path) -> None:
    src = write_lines(
        tmp_path / "s.jsonl", '{"id": "a", "text": "x", "source": "wiki", "meta": {"k": 1}, "n": [1]}'
    )
    sample = only(read_all(src))
    assert isinstance(sample, Sample)
    assert sample.meta == {"source": "wiki", "meta": {"k": 1}, "n": [1]}


def test_input_ids_win_over_text_and_the_text_is_kept_in_meta(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "s.jsonl", '{"id": "a", "text": "hi", "input_ids": [5, 6], "lang": "en"}')
    sample = only(read_all(src))
    assert isinstance(sample, Sample)
    assert sample.input_ids == [5, 6]
    assert sample.text is None
    assert sample.meta == {"text": "hi", "lang": "en"}


def test_id_is_derived_stably_from_content(tmp_path: Path) -> None:
    src = write_lines(
        tmp_path / "s.jsonl",
        '{"text": "hello", "topic": "greet"}',
        '{ "topic" : "greet",   "text":"hello" }',
    )
    first, second = read_all(src)
    assert isinstance(first, Sample) and isinstance(second, Sample)
    # Independent computation: sha1 of compact, key-sorted JSON of the whole object.
    canonical = json.dumps({"text": "hello", "topic": "greet"}, sort_keys=True, separators=(",", ":"))
    expected = "h" + hashlib.sha1(canonical.encode()).hexdigest()[:16]
    assert first.sample_id == expected
    assert second.sample_id == expected  # key order and whitespace do not matter
    assert len(expected) == 17


def test_derived_ids_differ_when_content_differs() -> None:
    assert derive_sample_id({"text": "a"}) != derive_sample_id({"text": "b"})
    assert derive_sample_id({"text": "a"}) != derive_sample_id({"text": "a", "x": 1})


def test_null_id_counts_as_absent_and_gets_a_derived_id(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "s.jsonl", '{"id": null, "text": "x"}')
    sample = only(read_all(src))
    assert isinstance(sample, Sample)
    assert sample.sample_id == derive_sample_id({"id": None, "text": "x"})
    assert sample.meta == {}


def test_null_input_ids_fall_back_to_text(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "s.jsonl", '{"id": "a", "input_ids": null, "text": "x"}')
    assert only(read_all(src)) == Sample(sample_id="a", line_no=1, input_ids=None, text="x", meta={})


def test_blank_lines_are_skipped_but_still_counted(tmp_path: Path) -> None:
    src = write_lines(
        tmp_path / "s.jsonl", "", '{"id": "a", "text": "x"}', "   ", "\t", '{"id": "b", "text": "y"}'
    )
    items = read_all(src)
    assert [(i.line_no, getattr(i, "sample_id", None)) for i in items] == [(2, "a"), (5, "b")]


def test_crlf_line_endings_and_a_last_line_without_newline_are_read(tmp_path: Path) -> None:
    src = tmp_path / "s.jsonl"
    src.write_bytes(b'{"id": "a", "text": "x"}\r\n{"id": "b", "text": "y"}')
    assert [i.sample_id for i in read_all(src) if isinstance(i, Sample)] == ["a", "b"]


def test_a_utf8_bom_on_the_first_line_is_ignored(tmp_path: Path) -> None:
    src = tmp_path / "s.jsonl"
    src.write_bytes(b'\xef\xbb\xbf{"id": "a", "text": "x"}\n')
    assert only(read_all(src)) == Sample(sample_id="a", line_no=1, input_ids=None, text="x", meta={})


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ('{"text": "x",}', "invalid JSON: "),
        ("[1, 2]", "not a JSON object"),
        ('"just a string"', "not a JSON object"),
        ('{"id": "a", "prompt": "x"}', 'no prompt: needs "input_ids" or "text"'),
        ('{"input_ids": []}', '"input_ids" must be a non-empty list of non-negative integers'),
        ('{"input_ids": [1, -2]}', '"input_ids" must be a non-empty list of non-negative integers'),
        ('{"input_ids": [1, 2.0]}', '"input_ids" must be a non-empty list of non-negative integers'),
        ('{"input_ids": [1, true]}', '"input_ids" must be a non-empty list of non-negative integers'),
        ('{"input_ids": ["1"]}', '"input_ids" must be a non-empty list of non-negative integers'),
        ('{"input_ids": [[1]]}', '"input_ids" must be a non-empty list of non-negative integers'),
        ('{"input_ids": "1 2 3"}', '"input_ids" must be a non-empty list of non-negative integers'),
        (
            '{"input_ids": [1, -2], "text": "ok"}',
            '"input_ids" must be a non-empty list of non-negative integers',
        ),
        ('{"text": ""}', '"text" must be a non-empty string'),
        ('{"text": 5}', '"text" must be a non-empty string'),
        ('{"id": 1.5, "text": "x"}', '"id" must be a string or integer'),
        ('{"id": true, "text": "x"}', '"id" must be a string or integer'),
        ('{"id": ["a"], "text": "x"}', '"id" must be a string or integer'),
        ('{"id": "", "text": "x"}', '"id" must not be an empty string'),
    ],
)
def test_a_bad_line_is_rejected_with_a_clear_reason(tmp_path: Path, line: str, reason: str) -> None:
    src = write_lines(tmp_path / "s.jsonl", '{"id": "ok", "text": "x"}', line)
    first, second = read_all(src)
    assert isinstance(first, Sample)
    assert isinstance(second, Rejected)
    assert second.line_no == 2
    assert second.reason.startswith(reason)
    if not reason.endswith(": "):
        assert second.reason == reason
    assert second.raw == line


def test_invalid_utf8_is_rejected_and_the_stream_goes_on(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "s.jsonl", b'{"text": "caf\xe9"}', '{"id": "b", "text": "y"}')
    rejected, sample = read_all(src)
    assert isinstance(rejected, Rejected)
    assert rejected.reason == "invalid UTF-8"
    assert rejected.line_no == 1
    assert rejected.raw == '{"text": "caf\ufffd"}'
    assert isinstance(sample, Sample) and sample.sample_id == "b"


def test_rejected_raw_is_truncated_to_200_chars(tmp_path: Path) -> None:
    line = "{" + "x" * 1000
    src = write_lines(tmp_path / "s.jsonl", line)
    rejected = only(read_all(src))
    assert isinstance(rejected, Rejected)
    assert rejected.raw == line[:RAW_PREVIEW_CHARS]
    assert RAW_PREVIEW_CHARS == 200
    assert Rejected(line_no=1, reason="r", raw="y" * 500).raw == "y" * 200


def test_start_line_skips_earlier_lines_and_keeps_true_line_numbers(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "s.jsonl", *[f'{{"id": "s{i}", "text": "t"}}' for i in range(1, 6)])
    items = read_all(src, start_line=4)
    assert [(i.line_no, getattr(i, "sample_id", None)) for i in items] == [(4, "s4"), (5, "s5")]


def test_start_line_skips_bad_lines_without_parsing_them(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "s.jsonl", "not json", '{"id": "a", "text": "x"}')
    assert read_all(src, start_line=2) == [
        Sample(sample_id="a", line_no=2, input_ids=None, text="x", meta={})
    ]


def test_start_line_past_the_end_yields_nothing(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "s.jsonl", '{"text": "x"}')
    assert read_all(src, start_line=99) == []


@pytest.mark.parametrize("start_line", [0, -1])
def test_start_line_below_one_is_a_value_error(tmp_path: Path, start_line: int) -> None:
    src = write_lines(tmp_path / "s.jsonl", '{"text": "x"}')
    with pytest.raises(ValueError, match="start_line"):
        iter_source(src, start_line)


def test_lines_are_read_lazily_as_the_iterator_advances(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "s.jsonl", '{"id": "a", "text": "x"}')
    it = iter_source(src)
    first = next(it)
    assert isinstance(first, Sample) and first.sample_id == "a"
    with open(src, "ab") as f:
        f.write(b'{"id": "b", "text": "y"}\n')
    rest = list(it)
    assert [i.sample_id for i in rest if isinstance(i, Sample)] == ["b"]


def test_missing_file_raises_source_error_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SourceError) as info:
        check_source(Path("data/b2.jsonl"))
    assert str(info.value) == "data/b2.jsonl: no such file"
    assert info.value.path == "data/b2.jsonl"
    assert info.value.reason == "no such file"


def test_iter_source_raises_for_a_missing_file_before_iteration(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="no such file"):
        iter_source(tmp_path / "missing.jsonl")


def test_a_directory_is_not_a_source(tmp_path: Path) -> None:
    with pytest.raises(SourceError) as info:
        check_source(tmp_path)
    assert str(info.value) == f"{tmp_path}: is a directory, not a file"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs mkfifo")
def test_a_fifo_is_not_a_source(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(SourceError, match="not a regular file"):
        check_source(fifo)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_file_is_a_source_error(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "s.jsonl", '{"text": "x"}')
    src.chmod(0)
    try:
        with pytest.raises(SourceError, match="cannot read"):
            check_source(src)
    finally:
        src.chmod(0o600)


def test_an_empty_file_is_a_valid_source_with_no_samples(tmp_path: Path) -> None:
    src = tmp_path / "empty.jsonl"
    src.write_bytes(b"")
    check_source(src)
    assert read_all(src) == []


def test_task_payload_round_trips_through_json(tmp_path: Path) -> None:
    src = write_lines(
        tmp_path / "s.jsonl",
        '{"id": 7, "input_ids": [1, 2], "text": "t", "k": {"a": [1]}}',
        '{"id": "b", "text": "hello"}',
    )
    samples = [i for i in read_all(src) if isinstance(i, Sample)]
    payloads = [s.to_task_payload() for s in samples]
    assert payloads == [
        {"sample_id": "7", "line_no": 1, "input_ids": [1, 2], "meta": {"text": "t", "k": {"a": [1]}}},
        {"sample_id": "b", "line_no": 2, "text": "hello", "meta": {}},
    ]
    decoded = [Sample.from_task_payload(orjson.loads(orjson.dumps(p))) for p in payloads]
    assert decoded == samples


@pytest.mark.parametrize(
    "payload",
    [
        {"line_no": 1, "text": "x", "meta": {}},
        {"sample_id": "a", "line_no": 0, "text": "x", "meta": {}},
        {"sample_id": "a", "line_no": 1, "meta": {}},
        {"sample_id": "a", "line_no": 1, "text": "x", "input_ids": [1], "meta": {}},
        {"sample_id": "a", "line_no": 1, "input_ids": [-1], "meta": {}},
        {"sample_id": "a", "line_no": 1, "text": "x", "meta": []},
    ],
)
def test_a_malformed_task_payload_is_a_value_error(payload: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="task payload"):
        Sample.from_task_payload(payload)


def test_a_sample_needs_exactly_one_prompt() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        Sample(sample_id="a", line_no=1, input_ids=[1], text="x", meta={})
    with pytest.raises(ValueError, match="exactly one"):
        Sample(sample_id="a", line_no=1, input_ids=None, text=None, meta={})


def test_samples_and_rejections_are_frozen() -> None:
    sample = Sample(sample_id="a", line_no=1, input_ids=None, text="x", meta={})
    with pytest.raises(AttributeError):
        sample.sample_id = "b"  # type: ignore[misc]
    assert not hasattr(sample, "__dict__")


def test_an_id_outside_the_vocabulary_is_rejected_with_its_position(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "s.jsonl", '{"input_ids": [1, 2, 3]}', '{"input_ids": [1, 2048, 3]}')
    reader = RecordReader(SourceOptions(vocab_size=2048))
    good, bad = list(iter_source(path, reader=reader))
    assert isinstance(good, Sample) and good.input_ids == [1, 2, 3]
    assert isinstance(bad, Rejected) and bad.line_no == 2
    assert bad.reason.startswith("input_ids[1] = 2048 is outside the model's vocabulary (ids 0 to 2047)")


def test_a_prompt_over_the_schedulers_input_limit_is_rejected(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "s.jsonl", json.dumps({"input_ids": list(range(11))}))
    (bad,) = list(iter_source(path, reader=RecordReader(SourceOptions(max_input_len=10))))
    assert isinstance(bad, Rejected)
    assert bad.reason == "prompt too long: 11 tokens, the servers take prompts of at most 10"
