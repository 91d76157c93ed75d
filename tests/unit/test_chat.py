"""Chat records to exact prompt tokens with a real tokenizer the test builds itself (no hub access):
``tests/support/tokenizer.py``, whose every id decodes to one word that encodes back to the same id."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from chat.templates import ChatError, ChatTokenizer, load_chat_tokenizer, plan_conversation, prompt_messages
from producer.source import (
    REASON_NEEDS_TOKENIZER,
    RecordReader,
    Rejected,
    Sample,
    SourceOptions,
)
from tests.support.tokenizer import CHATML, EOS_ID, make_chat_tokenizer, reference_ids


@pytest.fixture(scope="module")
def chat(tokenizer_dir: Path) -> ChatTokenizer:
    return load_chat_tokenizer(str(tokenizer_dir))


def reader(tokenizer_dir: Path | None, **options: Any) -> RecordReader:
    tokenizer = str(tokenizer_dir) if tokenizer_dir is not None else None
    return RecordReader(SourceOptions(tokenizer=tokenizer, **options))


CONVERSATION = [
    {"role": "user", "content": "what is two plus three"},
    {"role": "assistant", "content": "w5 w6"},
    {"role": "user", "content": "tell me more"},
    {"role": "assistant", "content": "w7"},
]


def test_the_tokenizer_the_tests_build_round_trips_any_reply(chat: ChatTokenizer) -> None:
    reply = [10, 42, 3, 7, 150]
    text = chat.reply_text([*reply, EOS_ID], {"type": "stop", "matched": EOS_ID})
    assert chat.encode(text) == reply
    assert chat.tokenizer.eos_token_id == EOS_ID


def test_a_messages_record_is_prompted_with_the_models_own_chat_template(tokenizer_dir: Path) -> None:
    sample = reader(tokenizer_dir).read({"id": "a", "messages": CONVERSATION}, 1)
    assert isinstance(sample, Sample)
    expected = reference_ids(tokenizer_dir, CONVERSATION[:3])
    assert sample.input_ids == expected
    assert expected[-2:] == [1, 5]  # ends with the generation prompt: <|im_start|> assistant
    assert sample.conversation == [*CONVERSATION[:3], {"role": "assistant", "content": None}]


def test_a_conversation_that_ends_with_a_user_turn_gets_a_reply_to_it(tokenizer_dir: Path) -> None:
    sample = reader(tokenizer_dir).read({"id": "a", "messages": CONVERSATION[:3]}, 1)
    assert isinstance(sample, Sample)
    assert sample.input_ids == reference_ids(tokenizer_dir, CONVERSATION[:3])


def test_regenerate_all_plans_a_reply_for_every_assistant_turn(tokenizer_dir: Path) -> None:
    sample = reader(tokenizer_dir, regenerate="all").read({"id": "a", "messages": CONVERSATION}, 1)
    assert isinstance(sample, Sample)
    assert sample.input_ids == reference_ids(tokenizer_dir, CONVERSATION[:1])
    reply = {"role": "assistant", "content": None}
    assert sample.conversation == [CONVERSATION[0], reply, CONVERSATION[2], reply]
    assert prompt_messages(sample.conversation, 1, ["new answer"]) == [
        CONVERSATION[0],
        {"role": "assistant", "content": "new answer"},
        CONVERSATION[2],
    ]


def test_the_system_prompt_comes_first_unless_the_record_has_its_own(tokenizer_dir: Path) -> None:
    read = reader(tokenizer_dir, system_prompt="you are terse").read
    plain = read({"id": "a", "messages": CONVERSATION[:1]}, 1)
    own = read({"id": "b", "messages": [{"role": "system", "content": "be a bot"}, CONVERSATION[0]]}, 2)
    assert isinstance(plain, Sample) and isinstance(own, Sample)
    system = {"role": "system", "content": "you are terse"}
    assert plain.input_ids == reference_ids(tokenizer_dir, [system, CONVERSATION[0]])
    assert own.input_ids == reference_ids(
        tokenizer_dir, [{"role": "system", "content": "be a bot"}, CONVERSATION[0]]
    )


def test_a_text_prompt_is_one_templated_user_turn_with_a_tokenizer_and_sent_as_is_without(
    tokenizer_dir: Path,
) -> None:
    templated = reader(tokenizer_dir).read({"id": "a", "prompt": "say hello"}, 1)
    raw = reader(None).read({"id": "a", "prompt": "say hello"}, 1)
    assert isinstance(templated, Sample) and isinstance(raw, Sample)
    assert templated.input_ids == reference_ids(tokenizer_dir, [{"role": "user", "content": "say hello"}])
    assert (raw.input_ids, raw.text) == (None, "say hello")
    assert raw.conversation == [
        {"role": "user", "content": "say hello"},
        {"role": "assistant", "content": None},
    ]


def test_a_chat_record_without_a_tokenizer_is_rejected_with_what_to_set() -> None:
    rejected = reader(None).read({"id": "a", "messages": CONVERSATION}, 4)
    assert isinstance(rejected, Rejected)
    assert (rejected.line_no, rejected.reason) == (4, REASON_NEEDS_TOKENIZER)
    assert "set tokenizer = " in REASON_NEEDS_TOKENIZER


def test_a_prompt_that_does_not_fit_the_context_is_rejected_with_its_sizes(tokenizer_dir: Path) -> None:
    ids = reference_ids(tokenizer_dir, CONVERSATION[:3])
    fits = reader(tokenizer_dir, context_length=len(ids) + 8, max_new_tokens=8)
    too_long = reader(tokenizer_dir, context_length=len(ids) + 8, max_new_tokens=9)
    longer_than_context = reader(tokenizer_dir, context_length=len(ids))
    record = {"id": "a", "messages": CONVERSATION}
    assert isinstance(fits.read(record, 1), Sample)
    rejected = too_long.read(record, 1)
    assert isinstance(rejected, Rejected)
    assert rejected.reason == (
        f"prompt too long: {len(ids)} tokens + max_new_tokens 9 = {len(ids) + 9}, "
        f"over the servers' context length of {len(ids) + 8}"
    )
    rejected = longer_than_context.read(record, 1)
    assert isinstance(rejected, Rejected)
    assert rejected.reason == f"prompt too long: {len(ids)} tokens, the servers' context length is {len(ids)}"


def test_pre_tokenized_prompts_are_checked_against_the_context_too() -> None:
    rejected = reader(None, context_length=4).read({"id": "a", "input_ids": [5, 6, 7, 8]}, 2)
    assert isinstance(rejected, Rejected)
    assert rejected.reason.startswith("prompt too long: 4 tokens")


@pytest.mark.parametrize(
    ("turns", "regenerate", "expected"),
    [
        (
            [
                {"role": "system", "content": "s"},
                {"role": "user", "content": "q"},
                {"role": "system", "content": "x"},
            ],
            "last",
            "nothing to answer: without its final assistant turn the conversation must end with a user turn",
        ),
        (
            [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}],
            "all",
            "an assistant turn comes before the first user turn: there is nothing it answers",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"},
                {"role": "assistant", "content": "b"},
            ],
            "all",
            "two assistant turns in a row (turns 2 and 3): each reply must answer a user turn",
        ),
    ],
)
def test_a_conversation_that_cannot_be_generated_says_why(
    turns: list[dict[str, str]], regenerate: str, expected: str
) -> None:
    assert plan_conversation(turns, regenerate) == expected


def test_a_chat_template_that_refuses_the_messages_rejects_the_record_with_its_message(
    tmp_path: Path,
) -> None:
    strict = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first turn must be user') }}{% endif %}"
    )
    folder = make_chat_tokenizer(tmp_path / "strict", chat_template=strict + CHATML)
    rejected = reader(folder).read(
        {"id": "a", "messages": [{"role": "system", "content": "s"}, *CONVERSATION]}, 3
    )
    assert isinstance(rejected, Rejected)
    assert rejected.reason == "chat template: first turn must be user"


def test_a_reply_is_decoded_without_special_tokens_and_its_stop(chat: ChatTokenizer) -> None:
    w5, w6 = chat.encode("w5 w6")
    assert chat.reply_text([w5, w6, EOS_ID], {"type": "stop", "matched": EOS_ID}) == "w5 w6"
    assert chat.reply_text([w5, w6], {"type": "stop", "matched": w6}) == "w5"
    assert chat.reply_text([w5, w6], {"type": "stop", "matched": " w6"}) == "w5"
    assert chat.reply_text([w5, w6], {"type": "length", "length": 2}) == "w5 w6"


def test_a_missing_tokenizer_folder_is_one_line_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ChatError) as info:
        load_chat_tokenizer(str(tmp_path / "nope"))
    assert str(info.value).startswith(f"tokenizer '{tmp_path / 'nope'}' cannot be loaded: ")
    assert "\n" not in str(info.value)


def test_a_tokenizer_without_a_chat_template_is_refused(tmp_path: Path) -> None:
    folder = make_chat_tokenizer(tmp_path / "bare", chat_template=None)
    with pytest.raises(ChatError, match="has no chat template"):
        load_chat_tokenizer(str(folder))
