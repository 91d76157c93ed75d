"""The export's pieces for training data: the loss mask over input_ids + output_ids, and a record's
conversation with its generated replies filled in."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.support.exports import stub_ledger, write_part
from tokenfleet.export import ExportError, export_dataset, loss_mask, reply_conversation

REPLY = {"role": "assistant", "content": None}
USER1 = {"role": "user", "content": "q1"}
USER2 = {"role": "user", "content": "q2"}


def decode(ids: Sequence[int], finish: Mapping[str, Any] | None) -> str:
    return " ".join(f"t{i}" for i in ids)


def test_the_loss_mask_is_one_on_the_output_only_for_a_single_reply() -> None:
    assert loss_mask({"input_ids": [1, 2, 3], "output_ids": [7, 8]}) == [0, 0, 0, 1, 1]


def test_a_record_the_server_tokenized_has_a_mask_over_its_output() -> None:
    assert loss_mask({"input_ids": None, "output_ids": [7, 8]}) == [1, 1]


def test_earlier_replies_are_masked_only_where_they_stand_verbatim_in_the_last_prompt() -> None:
    record = {
        # Prompt 1 = [1, 2], reply 1 = [7, 8]; prompt 2 adds [3] (reply 2 = [9] was re-rendered as [5]),
        # prompt 3 adds [4], reply 3 = [6].
        "input_ids": [1, 2, 7, 8, 3, 5, 4],
        "output_ids": [6],
        "turns": [
            {"prompt_tokens": 2, "output_ids": [7, 8], "in_context": True},
            {"prompt_tokens": 5, "output_ids": [9], "in_context": False},  # rewritten by the template
            {"prompt_tokens": 7, "output_ids": [6], "in_context": True},
        ],
    }
    assert loss_mask(record) == [0, 0, 1, 1, 0, 0, 0, 1]


def test_a_single_reply_is_decoded_from_its_exact_ids() -> None:
    record = {"conversation": [USER1, REPLY], "output_ids": [4, 5], "text": "server text"}
    assert reply_conversation(record, decode) == [USER1, {"role": "assistant", "content": "t4 t5"}]
    assert reply_conversation(record, None) == [USER1, {"role": "assistant", "content": "server text"}]


def test_a_conversation_cut_by_the_budget_ends_after_its_last_reply() -> None:
    record = {"conversation": [USER1, REPLY, USER2, REPLY], "turns": [{"content": "a1"}]}
    assert reply_conversation(record, decode) == [USER1, {"role": "assistant", "content": "a1"}]


def test_every_reply_of_a_conversation_comes_from_its_turns() -> None:
    record = {"conversation": [USER1, REPLY, USER2, REPLY], "turns": [{"content": "a1"}, {"content": "a2"}]}
    assert reply_conversation(record, decode) == [
        USER1,
        {"role": "assistant", "content": "a1"},
        USER2,
        {"role": "assistant", "content": "a2"},
    ]


def test_a_record_without_a_conversation_has_nothing_to_write() -> None:
    assert reply_conversation({"input_ids": [1], "output_ids": [2]}, decode) is None


def test_specforge_rows_leave_out_truncated_and_pre_tokenized_samples_and_count_them(tmp_path: Path) -> None:
    base = {"attempt": "a", "output_ids": [4], "text": "hi", "completion_tokens": 1}
    records = [
        {**base, "id": "ok", "conversation": [USER1, REPLY], "truncated": False},
        {**base, "id": "cut", "conversation": [USER1, REPLY], "truncated": True},
        {**base, "id": "ids", "input_ids": [1, 2], "truncated": False},
    ]
    write_part(tmp_path / "out" / "ds", records)
    ledger = stub_ledger({"output_dir": str(tmp_path / "out")}, {str(r["id"]): "a" for r in records})

    report = export_dataset(ledger, "ds", tmp_path / "sf.jsonl", format="specforge")
    everything = export_dataset(
        ledger, "ds", tmp_path / "all.jsonl", format="sharegpt", include_truncated=True
    )

    assert [orjson.loads(line) for line in (tmp_path / "sf.jsonl").read_bytes().splitlines()] == [
        {"id": "ok", "conversations": [USER1, {"role": "assistant", "content": "hi"}]}
    ]
    assert (report.records, report.tokens, report.skipped_truncated, report.skipped_no_conversation) == (
        1,
        1,
        1,
        1,
    )
    assert (everything.records, everything.skipped_truncated) == (2, 0)
    tokens = export_dataset(ledger, "ds", tmp_path / "tok.jsonl")
    assert (tokens.records, tokens.tokens) == (3, 3)


def test_an_export_whose_tokenizer_is_missing_here_is_one_clear_error(tmp_path: Path) -> None:
    ledger = stub_ledger({"output_dir": str(tmp_path), "tokenizer": "/nowhere/tok"}, {})
    with pytest.raises(ExportError) as info:
        export_dataset(ledger, "ds", tmp_path / "x.jsonl", format="specforge")
    assert str(info.value).startswith("dataset 'ds': tokenizer '/nowhere/tok' cannot be loaded: ")
    assert str(info.value).endswith(
        "(conversations are decoded with the dataset's tokenizer; --format tokens needs none)"
    )
    assert not (tmp_path / "x.jsonl").exists()
