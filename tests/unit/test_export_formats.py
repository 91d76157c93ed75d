"""The export formats a trainer loads: exact-id rows (SpecForge pre-tokenized, vllm speculators), the tokens
export without a field pair a trainer misreads, and the count of text replies that do not re-tokenize to
their ids (pure logic; SpecForge itself loads them in ``tests/conformance/test_trainers.py``); and the warning
that an export of a dataset still running holds only what is committed so far."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest

from budget import DatasetState
from tests.support.exports import stub_ledger, write_part
from tests.support.snapshots import snapshot_of
from tests.support.tokenizer import make_chat_tokenizer
from tokenfleet.export import export_dataset, unsettled_warning, with_system_turn
from tokenfleet.exports.retokenize import Mismatch, Reply, check_row, content_ids, replies_of
from tokenfleet.exports.token_rows import specforge_tokens_row, speculators_rows

USER1 = {"role": "user", "content": "q1"}
USER2 = {"role": "user", "content": "q2"}
REPLY = {"role": "assistant", "content": None}

#: A conversation of two replies: prompt 1 = [1, 2], reply 1 = [7, 8]; prompt 2 = prompt 1 + reply 1 + [3];
#: reply 2 = [9].
TWO_REPLIES: dict[str, Any] = {
    "id": "c",
    "input_ids": [1, 2, 7, 8, 3],
    "output_ids": [9],
    "turns": [
        {"prompt_tokens": 2, "output_ids": [7, 8], "in_context": True, "finish_reason": {"type": "length"}},
        {"prompt_tokens": 5, "output_ids": [9], "in_context": True, "finish_reason": {"type": "length"}},
    ],
}


def test_a_specforge_tokens_row_holds_the_whole_sequence_with_a_mask_of_the_same_length() -> None:
    row = specforge_tokens_row({"id": 5, "input_ids": [1, 2, 3], "output_ids": [7, 8]})
    assert row == {"id": "5", "input_ids": [1, 2, 3, 7, 8], "loss_mask": [0, 0, 0, 1, 1]}


def test_a_specforge_tokens_row_of_a_conversation_masks_every_reply_standing_verbatim() -> None:
    row = specforge_tokens_row(TWO_REPLIES)
    assert row is not None
    assert row["input_ids"] == [1, 2, 7, 8, 3, 9]
    assert row["loss_mask"] == [0, 0, 1, 1, 0, 1]


def test_a_sample_whose_prompt_the_server_tokenized_has_no_token_row() -> None:
    assert specforge_tokens_row({"id": "t", "input_ids": None, "output_ids": [7]}) is None


def test_speculators_rows_are_one_per_reply_each_with_its_own_exact_prompt() -> None:
    conversation = [
        USER1,
        {"role": "assistant", "content": "a1"},
        USER2,
        {"role": "assistant", "content": "a2"},
    ]
    rows, left_out = speculators_rows(TWO_REPLIES, conversation)
    assert left_out == 0
    assert [(r["id"], r["primary_id"], r["input_ids"], r["loss_mask"]) for r in rows] == [
        ("c_gen0", "c", [1, 2, 7, 8], [0, 0, 1, 1]),
        ("c_gen1", "c", [1, 2, 7, 8, 3, 9], [0, 0, 0, 0, 0, 1]),
    ]
    assert rows[0]["conversations"] == conversation[:2]
    assert rows[1]["metadata"]["finish_reason"] == "length"
    assert rows[1]["metadata"]["usage"] == {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}


def test_a_speculators_reply_the_template_rewrote_is_left_out_and_counted() -> None:
    record = {
        **TWO_REPLIES,
        "turns": [{**TWO_REPLIES["turns"][0], "in_context": False}, TWO_REPLIES["turns"][1]],
    }
    rows, left_out = speculators_rows(record, None)
    assert ([r["id"] for r in rows], left_out) == (["c_gen1"], 1)


class CharChat:
    """A chat template ``role:<header>content\\n`` over a character tokenizer that merges "ab" into one token
    (id 1000) and " x" into one token (id 1001): the merges a real BPE makes across a decoded boundary."""

    def __init__(self, empty_system_renders: bool = True, header: str = "") -> None:
        self.empty_system_renders = empty_system_renders
        self.header = header

    def render(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        text = "".join(
            f"{m['role']}:{self.header}{m['content']}\n"
            for m in messages
            if self.empty_system_renders or m["role"] != "system" or m["content"]
        )
        return text + (f"assistant:{self.header}" if add_generation_prompt else "")

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        i = 0
        while i < len(text):
            pair = text[i : i + 2]
            if pair in ("ab", " x"):
                ids.append(1000 if pair == "ab" else 1001)
                i += 2
            else:
                ids.append(ord(text[i]))
                i += 1
        return ids


def conversation_with(reply: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": reply}]


def test_a_reply_that_re_tokenizes_to_its_ids_is_not_a_mismatch() -> None:
    chat = CharChat()
    prompt = chat.encode(chat.render([{"role": "user", "content": "hi"}]))
    # The reply " yes" as generated: " " then "yes"; the stop token 2 is not in the text.
    reply = Reply([ord(c) for c in " yes"] + [2], {"type": "stop", "matched": 2}, prompt)
    assert check_row(chat, "s", conversation_with(" yes"), [reply]) == []


def test_a_reply_generated_as_a_split_the_tokenizer_merges_is_a_mismatch_at_that_token() -> None:
    chat = CharChat()
    prompt = chat.encode(chat.render([{"role": "user", "content": "hi"}]))
    # Generated " q", "a", "b" separately; encoding the text merges "ab".
    reply = Reply([ord(" "), ord("q"), ord("a"), ord("b")], {"type": "length"}, prompt)
    assert check_row(chat, "s", conversation_with(" qab"), [reply]) == [Mismatch("s", 1, "reply", 2)]


def test_a_reply_whose_first_token_merges_with_the_header_is_a_boundary_mismatch() -> None:
    chat = CharChat(header=" ")
    prompt = chat.encode(chat.render([{"role": "user", "content": "hi"}]))
    # The header ends with a space and the reply starts with "x": encoded together they are one token.
    reply = Reply([ord("x"), ord("o")], {"type": "length"}, prompt)
    (found,) = check_row(chat, "s", conversation_with("xo"), [reply])
    assert (found.where, found.reply, found.token) == ("boundary", 1, len(prompt) - 1)


def test_a_row_whose_prompt_is_not_the_one_the_model_saw_is_a_prompt_mismatch() -> None:
    chat = CharChat()
    seen = chat.encode(chat.render([{"role": "user", "content": "hi"}]))
    row = [{"role": "system", "content": "be nice"}, *conversation_with("ok")]
    (found,) = check_row(chat, "s", row, [Reply([ord("o"), ord("k")], None, seen)])
    assert (found.where, found.token) == ("prompt", 0)


def test_the_stop_token_that_ended_a_reply_is_not_part_of_its_text() -> None:
    assert content_ids([5, 6, 2], {"type": "stop", "matched": 2}) == [5, 6]
    assert content_ids([5, 6, 2], {"type": "length"}) == [5, 6, 2]


def test_a_conversation_pairs_each_reply_with_its_prompt_when_it_is_on_record() -> None:
    replies = replies_of(TWO_REPLIES)
    assert [(r.output_ids, r.prompt_ids) for r in replies] == [([7, 8], [1, 2]), ([9], [1, 2, 7, 8, 3])]


def test_an_empty_system_turn_is_written_only_where_the_template_renders_it_as_none() -> None:
    row = conversation_with("ok")
    assert with_system_turn(row, CharChat(empty_system_renders=False))[0] == {"role": "system", "content": ""}
    assert with_system_turn(row, CharChat(empty_system_renders=True)) == row
    own = [{"role": "system", "content": "be nice"}, *row]
    assert with_system_turn(own, CharChat()) == own


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_every_format_but_tokens_leaves_out_what_a_trainer_cannot_load_and_counts_it(tmp_path: Path) -> None:
    base = {"attempt": "a", "completion_tokens": 1, "truncated": False, "conversation": [USER1, REPLY]}
    records = [
        {**base, "id": "ok", "input_ids": [1, 2], "output_ids": [4]},
        {**base, "id": "cut", "input_ids": [1, 2], "output_ids": [4], "truncated": True},
        {**base, "id": "text", "input_ids": None, "output_ids": [4]},
        {**base, "id": "empty", "input_ids": [1, 2], "output_ids": [], "completion_tokens": 0},
    ]
    write_part(tmp_path / "out" / "ds", records)
    ledger = stub_ledger({"output_dir": str(tmp_path / "out")}, {str(r["id"]): "a" for r in records})

    sf = export_dataset(ledger, "ds", tmp_path / "sf.jsonl", format="specforge-tokens")
    spec = export_dataset(ledger, "ds", tmp_path / "spec.jsonl", format="speculators", include_truncated=True)
    tokens = export_dataset(ledger, "ds", tmp_path / "tok.jsonl")

    assert read_rows(tmp_path / "sf.jsonl") == [{"id": "ok", "input_ids": [1, 2, 4], "loss_mask": [0, 0, 1]}]
    assert (sf.records, sf.skipped_truncated, sf.skipped_no_prompt_ids, sf.skipped_empty) == (1, 1, 1, 1)
    assert [r["id"] for r in read_rows(tmp_path / "spec.jsonl")] == ["ok_gen0", "cut_gen0"]
    assert (spec.records, spec.skipped_truncated) == (2, 0)
    tok_rows = read_rows(tmp_path / "tok.jsonl")
    assert tokens.records == 4
    # No input_ids + loss_mask pair: a trainer would take the prompt for the whole sequence.
    assert all("loss_mask" not in r for r in tok_rows)
    assert tok_rows[0]["generated_mask"] == [0, 0, 1]


def test_a_text_export_counts_the_replies_that_do_not_re_tokenize_and_says_where(tmp_path: Path) -> None:
    tokenizer = make_chat_tokenizer(tmp_path / "tok")
    from chat.templates import load_chat_tokenizer

    chat = load_chat_tokenizer(str(tokenizer))
    system = {"role": "system", "content": "you are a helpful bot"}
    conversation: list[dict[str, Any]] = [system, {"role": "user", "content": "tell me more"}, REPLY]
    prompt = chat.prompt_ids(conversation[:2])
    hello, again, im_start = chat.encode("hello again") + chat.encode("<|im_start|>")
    base = {"attempt": "a", "completion_tokens": 3, "truncated": False, "conversation": conversation}
    records = [
        # Decodes and re-encodes to the same ids (the EOS that ended it is not in the text).
        {
            **base,
            "id": "same",
            "input_ids": prompt,
            "output_ids": [hello, again, 2],
            "finish_reason": {"type": "stop", "matched": 2},
        },
        # A special token in the middle of a reply is dropped by the decoding: the text loses it.
        {
            **base,
            "id": "lost",
            "input_ids": prompt,
            "output_ids": [hello, im_start, again],
            "finish_reason": {"type": "length"},
        },
    ]
    write_part(tmp_path / "out" / "ds", records)
    ledger = stub_ledger(
        {"output_dir": str(tmp_path / "out"), "tokenizer": str(tokenizer)}, {"same": "a", "lost": "a"}
    )

    report = export_dataset(ledger, "ds", tmp_path / "sf.jsonl", format="specforge")

    assert (report.records, report.replies_checked, report.mismatches) == (2, 2, 1)
    assert report.mismatch_examples == (Mismatch("lost", 1, "reply", 1),)
    assert report.mismatch_path is not None
    assert read_rows(report.mismatch_path) == [{"id": "lost", "reply": 1, "where": "reply", "token": 1}]
    assert all(r["conversations"][0] == system for r in read_rows(tmp_path / "sf.jsonl"))
    assert report.no_system_turn == 0


def test_an_export_of_a_dataset_still_running_warns_that_it_holds_what_is_committed_so_far() -> None:
    running = snapshot_of("B2", samples=1200, queued=40, inflight=8, pending=3)

    assert unsettled_warning(running, 1200) == (
        "B2 is still running (40 queued, 8 in flight, 3 to feed again, its source not all read yet): "
        "this export holds the 1,200 samples committed so far"
    )


@pytest.mark.parametrize(
    ("changes", "doing"),
    [
        ({"state": DatasetState.PAUSED}, "B2 is paused (0 queued, 0 in flight, 5 not sent yet)"),
        ({"state": DatasetState.EXHAUSTED, "inflight": 2}, "B2 is exhausted and still finishing (0 queued"),
    ],
)
def test_an_export_of_a_paused_or_still_finishing_dataset_warns_too(
    changes: dict[str, Any], doing: str
) -> None:
    s = snapshot_of("B2", samples=95, source_total=100, source_done=True, **changes)

    warning = unsettled_warning(s, 95)

    assert warning is not None and warning.startswith(doing), warning


def test_an_export_of_a_settled_dataset_has_no_warning() -> None:
    done = snapshot_of("B2", samples=100, source_total=100, source_done=True)
    stopped = snapshot_of("B2", samples=40, state=DatasetState.REVOKED, pending=60)
    assert done.settled and stopped.settled

    assert unsettled_warning(done, 100) is None
    assert unsettled_warning(stopped, 40) is None


def test_the_export_report_counts_the_samples_committed_when_it_read_the_ledger(tmp_path: Path) -> None:
    records = [
        {"id": str(i), "attempt": "a", "completion_tokens": 1, "input_ids": [1], "output_ids": [2]}
        for i in range(3)
    ]
    write_part(tmp_path / "out" / "ds", records)
    ledger = stub_ledger({"output_dir": str(tmp_path / "out")}, {str(r["id"]): "a" for r in records})

    report = export_dataset(ledger, "ds", tmp_path / "tok.jsonl", format="specforge")

    assert (report.committed, report.records) == (3, 0)  # no conversation to write: none in this format
