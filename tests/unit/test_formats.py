"""Record shapes: each one read into a normalised record, forced formats, ids and meta."""

from __future__ import annotations

from typing import Any

import pytest

from producer.formats import Record, derive_sample_id, read_record

CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "hi"},
]


def record(obj: dict[str, Any], fmt: str = "auto", id_field: str = "id") -> Record:
    out = read_record(obj, fmt, id_field)
    assert isinstance(out, Record), out
    return out


def reason(obj: dict[str, Any], fmt: str = "auto", id_field: str = "id") -> str:
    out = read_record(obj, fmt, id_field)
    assert isinstance(out, str), out
    return out


def test_openai_messages_become_role_content_turns() -> None:
    r = record({"id": "a", "messages": CHAT, "source": "x"})
    assert (r.sample_id, r.shape, r.turns, r.meta) == ("a", "messages", CHAT, {"source": "x"})


def test_sharegpt_turns_are_mapped_to_system_user_and_assistant() -> None:
    conversations = [
        {"from": "system", "value": "be brief"},
        {"from": "human", "value": "hello"},
        {"from": "gpt", "value": "hi"},
    ]
    r = record({"id": "a", "conversations": conversations})
    assert r.shape == "sharegpt"
    assert r.turns == CHAT


def test_specforge_conversations_are_told_apart_from_sharegpt_by_their_keys() -> None:
    r = record({"id": "a", "conversations": CHAT})
    assert r.shape == "specforge"
    assert r.turns == CHAT


def test_text_and_prompt_records_are_one_user_message() -> None:
    assert record({"text": "hello"}).text == "hello"
    prompt = record({"prompt": "hello", "topic": 1})
    assert (prompt.shape, prompt.text, prompt.meta) == ("text", "hello", {"topic": 1})


def test_input_ids_win_over_every_other_shape_and_the_rest_stays_in_meta() -> None:
    r = record({"input_ids": [5, 6], "messages": CHAT})
    assert (r.shape, r.input_ids, r.meta) == ("input_ids", [5, 6], {"messages": CHAT})


def test_openai_content_parts_are_joined_into_one_text() -> None:
    parts = [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]
    r = record({"messages": [{"role": "user", "content": parts}]})
    assert r.turns == [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize(
    ("fmt", "obj", "expected"),
    [
        ("messages", {"conversations": CHAT}, 'not a messages record: needs "messages"'),
        ("sharegpt", {"messages": CHAT}, 'not a sharegpt record: needs "conversations"'),
        ("text", {"input_ids": [1]}, 'not a text record: needs "text" or "prompt"'),
        ("input_ids", {"text": "x"}, 'not an input_ids record: needs "input_ids"'),
    ],
)
def test_a_forced_format_reads_only_its_own_shape(fmt: str, obj: dict[str, Any], expected: str) -> None:
    assert reason(obj, fmt) == expected


def test_a_forced_sharegpt_format_refuses_role_content_turns() -> None:
    assert reason({"conversations": CHAT}, "sharegpt").startswith('"conversations"[0]: needs a "from"')


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        ({"messages": []}, '"messages" must be a non-empty list of turns'),
        ({"messages": "hi"}, '"messages" must be a non-empty list of turns'),
        ({"messages": ["hi"]}, '"messages"[0]: not an object'),
        ({"messages": [{"content": "x"}]}, '"messages"[0]: needs a "role"'),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]},
            '"messages"[1]: role "tool" is not supported (only system, user and assistant turns)',
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            '"messages"[0]: "content" must be a string or a list of text parts',
        ),
        ({"messages": [{"role": "system", "content": "x"}]}, '"messages": no user turn'),
        (
            {"conversations": [{"from": "observation", "value": "x"}]},
            '"conversations"[0]: "from": "observation" is not supported (only system, human and gpt turns)',
        ),
        ({"conversations": [{"from": "human", "value": 3}]}, '"conversations"[0]: "value" must be a string'),
        ({"prompt": ""}, '"prompt" must be a non-empty string'),
        ({"topic": "x"}, 'no prompt: needs "input_ids", "messages", "conversations", "text" or "prompt"'),
    ],
)
def test_a_bad_chat_record_gets_a_reason_naming_the_field(obj: dict[str, Any], expected: str) -> None:
    assert reason(obj) == expected


def test_a_configured_id_field_names_the_sample_and_a_plain_id_stays_in_meta() -> None:
    r = record({"uuid": "u-1", "id": 7, "messages": CHAT}, id_field="uuid")
    assert r.sample_id == "u-1"
    assert r.meta == {"id": 7}
    assert reason({"uuid": 1.5, "text": "x"}, id_field="uuid") == '"uuid" must be a string or integer'


def test_a_record_without_its_id_field_gets_an_id_derived_from_its_content() -> None:
    obj = {"messages": CHAT, "topic": "greet"}
    assert record(obj).sample_id == derive_sample_id(obj)
    assert record(dict(reversed(obj.items()))).sample_id == derive_sample_id(obj)
    assert record({"messages": CHAT[1:]}).sample_id != derive_sample_id(obj)


def test_null_fields_count_as_absent_and_are_dropped() -> None:
    r = record({"id": None, "input_ids": None, "messages": CHAT, "text": None, "k": None})
    assert r.shape == "messages"
    assert r.meta == {"k": None}
