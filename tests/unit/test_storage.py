"""The output folder's markers (budget/storage.py) and a dataset's fingerprints (tokenfleet/fingerprint.py):
pure file and byte logic."""

from __future__ import annotations

import os
from pathlib import Path

import orjson
import pytest

from budget.storage import (
    STORAGE_MARKER,
    check_same_storage,
    ensure_storage_marker,
    probe_writable,
    read_marker,
    write_marker,
)
from tokenfleet.fingerprint import (
    compare_sources,
    decode,
    encode,
    settings_changes,
    source_fingerprint,
)


def test_the_storage_marker_is_created_once_and_then_kept(tmp_path: Path) -> None:
    token = ensure_storage_marker(tmp_path / "out")
    assert len(token) == 32
    assert ensure_storage_marker(tmp_path / "out") == token
    assert read_marker(tmp_path / "out" / STORAGE_MARKER) == token


def test_the_same_storage_passes_the_check(tmp_path: Path) -> None:
    token = ensure_storage_marker(tmp_path)
    assert check_same_storage(tmp_path, token) is None


def test_a_missing_output_dir_is_named_as_unmounted_storage(tmp_path: Path) -> None:
    problem = check_same_storage(tmp_path / "nowhere", "abc")
    assert problem is not None and "does not exist here" in problem and str(tmp_path / "nowhere") in problem


def test_an_output_dir_without_the_marker_is_other_storage(tmp_path: Path) -> None:
    problem = check_same_storage(tmp_path, "abc")
    assert problem is not None and f"{STORAGE_MARKER} is missing" in problem


def test_an_output_dir_with_another_token_is_other_storage(tmp_path: Path) -> None:
    write_marker(tmp_path / STORAGE_MARKER, "other")
    problem = check_same_storage(tmp_path, "mine")
    assert problem is not None and "another token" in problem


def test_a_marker_write_leaves_no_temporary_file(tmp_path: Path) -> None:
    write_marker(tmp_path / "m", "t1")
    write_marker(tmp_path / "m", "t2")
    assert [p.name for p in tmp_path.iterdir()] == ["m"] and read_marker(tmp_path / "m") == "t2"


def test_a_writable_folder_passes_the_probe_and_keeps_no_probe_file(tmp_path: Path) -> None:
    assert probe_writable(tmp_path / "new" / "folder") is None
    assert list((tmp_path / "new" / "folder").iterdir()) == []


def test_a_folder_that_refuses_files_fails_the_probe_with_the_reason(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        folder = Path("/sys")  # root writes anywhere but in sysfs
    else:
        folder = tmp_path / "ro"
        folder.mkdir()
        folder.chmod(0o555)
    problem = probe_writable(folder)
    assert problem is not None and problem.startswith(f"cannot write in {folder}: ")


def test_a_folder_under_a_file_fails_the_probe(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    problem = probe_writable(tmp_path / "f" / "out")
    assert problem is not None and problem.startswith("cannot create")


def test_settings_changes_name_each_setting_old_and_new() -> None:
    old = {"sampling": {"max_new_tokens": 256, "temperature": 0.7}, "tokenizer": None}
    new = {"sampling": {"max_new_tokens": 128, "top_p": 0.9}, "tokenizer": None}
    assert settings_changes(old, new) == [
        "sampling.max_new_tokens: 256 -> 128",
        "sampling.temperature: 0.7 -> unset",
        "sampling.top_p: unset -> 0.9",
    ]
    assert settings_changes(old, old) == []


def _source(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def test_an_unchanged_source_compares_equal_through_its_stored_form(tmp_path: Path) -> None:
    rows = [{"text": f"t{i}"} for i in range(50)]
    fp = source_fingerprint(_source(tmp_path / "a.jsonl", rows))
    assert len(fp) == 16 * 50
    change = compare_sources(decode(encode(fp)), fp)
    assert (change.changed, change.removed, change.added, change.first_line) == (0, 0, 0, None)
    assert not change.rewrites and change.describe() == "unchanged"


def test_an_edited_line_without_an_id_counts_as_changed_and_names_its_line(tmp_path: Path) -> None:
    rows = [{"text": f"t{i}"} for i in range(10)]
    old = source_fingerprint(_source(tmp_path / "a.jsonl", rows))
    rows[6] = {"text": "edited"}
    rows[3] = {"text": "edited too"}
    change = compare_sources(old, source_fingerprint(_source(tmp_path / "b.jsonl", rows)))
    assert (change.removed, change.added, change.first_line) == (2, 2, 4)
    assert change.rewrites and change.describe() == "2 line(s) changed or removed, 2 added (first at line 4)"


def test_an_edited_line_with_an_id_counts_as_changed(tmp_path: Path) -> None:
    rows = [{"id": f"s{i}", "text": f"t{i}"} for i in range(10)]
    old = source_fingerprint(_source(tmp_path / "a.jsonl", rows))
    rows[7] = {"id": "s7", "text": "new"}
    change = compare_sources(old, source_fingerprint(_source(tmp_path / "b.jsonl", rows)))
    assert (change.changed, change.removed, change.added, change.first_line) == (1, 0, 0, 8)


def test_lines_appended_are_additions_only(tmp_path: Path) -> None:
    rows = [{"text": f"t{i}"} for i in range(5)]
    old = source_fingerprint(_source(tmp_path / "a.jsonl", rows))
    change = compare_sources(old, source_fingerprint(_source(tmp_path / "b.jsonl", [*rows, {"text": "x"}])))
    assert (change.changed, change.removed, change.added, change.first_line) == (0, 0, 1, 6)
    assert not change.rewrites


@pytest.mark.parametrize("bad", [b"not json", b"[1, 2]"])
def test_lines_that_are_not_json_objects_are_left_out(tmp_path: Path, bad: bytes) -> None:
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"text": "a"}\n' + bad + b'\n{"text": "b"}\n')
    assert len(source_fingerprint(path)) == 32
