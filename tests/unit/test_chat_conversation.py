"""A sample of several replies in the worker (`workers.conversation`), against a scripted client: each
reply's prompt holds the replies before it, finished replies survive a retry, a later 4xx ends the
conversation with what it has, and a stop returns the partial reply."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from budget.spec import DatasetSpec
from chat.templates import load_chat_tokenizer
from producer.source import RecordReader, Sample, SourceOptions
from tests.support.tokenizer import CHATML, EOS_ID, make_chat_tokenizer, reference_ids
from workers.continuation import requests_taken
from workers.conversation import Conversation, ConversationError, ConversationGeneration, record_fields
from workers.sglang.client import Generation, RequestRejected, ServerUnavailable

TURNS = [
    {"role": "user", "content": "what is two plus three"},
    {"role": "assistant", "content": "w1"},
    {"role": "user", "content": "tell me more"},
    {"role": "assistant", "content": "w2"},
    {"role": "user", "content": "why"},
]
CHUNK = 2


class ScriptedClient:
    """Answers each prompt with ids derived from it (like the simulator), in chunks through on_tokens;
    like the real client, the last chunk is not passed to on_tokens."""

    def __init__(self, fail: dict[int, Exception] | None = None) -> None:
        self.prompts: list[list[int]] = []
        self.fail = fail or {}

    @staticmethod
    def reply_for(prompt: list[int]) -> list[int]:
        digest = hashlib.sha1(repr(prompt).encode()).digest()
        return [10 + b % 150 for b in digest[:5]] + [EOS_ID]

    def generate(
        self,
        server: str,
        *,
        rid: str,
        sampling_params: dict[str, Any],
        input_ids: list[int] | None = None,
        text: str | None = None,
        timeout_s: float = 1.0,
        on_tokens: Callable[[int], bool] | None = None,
        stop: object = None,
        stall_timeout_s: object = None,
    ) -> Generation:
        assert input_ids is not None and text is None
        call = len(self.prompts)
        self.prompts.append(list(input_ids))
        out = self.reply_for(input_ids)
        limit = int(sampling_params.get("max_new_tokens") or 0)
        capped = 0 < limit < len(out)
        if capped:  # cut at max_new_tokens, as a server does
            out = out[:limit]
        produced: list[int] = []
        stopped = False
        for start in range(0, len(out), CHUNK):
            chunk = out[start : start + CHUNK]
            produced += chunk
            assert on_tokens is not None
            if start + CHUNK < len(out) and not on_tokens(len(chunk)):
                stopped = True
                break
        if call in self.fail:
            raise self.fail[call]
        finish = {"type": "abort", "message": "Aborted"} if stopped else {"type": "stop", "matched": EOS_ID}
        if capped and not stopped:
            finish = {"type": "length", "length": limit}
        return Generation(
            rid, server, produced, "", finish, len(input_ids), len(produced), stopped_by_us=stopped
        )


def spec_of(tokenizer_dir: Path) -> DatasetSpec:
    return DatasetSpec(servers=(), output_dir="", tokenizer=str(tokenizer_dir))


def sample_of(tokenizer_dir: Path, turns: list[dict[str, str]] = TURNS) -> dict[str, Any]:
    reader = RecordReader(SourceOptions(tokenizer=str(tokenizer_dir), regenerate="all"))
    sample = reader.read({"id": "s1", "messages": turns}, 1)
    assert isinstance(sample, Sample)
    return {**sample.to_task_payload(), "sample_id": "s1"}


class Run:
    """The task's side: counts tokens like on_tokens does, and what keep_turn reset."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.live = self.total = 0
        self.kept_calls = 0
        self.stop_after = stop_after

    def on_tokens(self, n: int) -> bool:
        self.live += n
        self.total += n
        return self.stop_after is None or self.total < self.stop_after

    def keep_turn(self) -> None:
        self.kept_calls += 1
        self.live = 0


def generate(conversation: Conversation, client: ScriptedClient, run: Run) -> Generation:
    fn = conversation.generator(client, run.keep_turn)  # type: ignore[arg-type]
    return fn("http://s", rid="r" * 40, sampling_params={}, timeout_s=5.0, on_tokens=run.on_tokens)


def test_each_reply_is_prompted_with_the_replies_generated_before_it(tokenizer_dir: Path) -> None:
    sample = sample_of(tokenizer_dir)
    conversation = Conversation.of(sample, spec_of(tokenizer_dir), "ds")
    assert conversation is not None and conversation.replies == 3
    client, run = ScriptedClient(), Run()

    gen = generate(conversation, client, run)

    chat = load_chat_tokenizer(str(tokenizer_dir))
    replies = [ScriptedClient.reply_for(p) for p in client.prompts]
    texts = [chat.reply_text(r, {"type": "stop", "matched": EOS_ID}) for r in replies]
    history = [TURNS[0]]
    expected_prompts = []
    for i, user in enumerate([None, TURNS[2], TURNS[4]]):
        if user is not None:
            history += [{"role": "assistant", "content": texts[i - 1]}, user]
        expected_prompts.append(reference_ids(tokenizer_dir, history))
    assert client.prompts == expected_prompts
    assert isinstance(gen, ConversationGeneration)
    assert [t["output_ids"] for t in gen.turns] == replies
    assert [t["content"] for t in gen.turns] == texts
    assert [t["prompt_tokens"] for t in gen.turns] == [len(p) for p in expected_prompts]
    assert gen.completion_tokens == sum(len(r) for r in replies)
    assert (gen.output_ids, gen.prompt_ids) == (replies[-1], expected_prompts[-1])
    assert all(t["in_context"] for t in gen.turns)
    assert run.kept_calls == 3
    # Every token of a reply reached the ledger before the next reply started.
    assert run.total == len(replies[0]) + len(replies[1]) + len(replies[2]) - CHUNK
    fields = record_fields(sample, gen)
    assert fields["input_ids"] == expected_prompts[-1]
    assert fields["conversation"] == sample["conversation"]


def test_a_retry_resumes_at_the_reply_that_failed(tokenizer_dir: Path) -> None:
    conversation = Conversation.of(sample_of(tokenizer_dir), spec_of(tokenizer_dir), "ds")
    assert conversation is not None
    client = ScriptedClient(fail={1: ServerUnavailable("HTTP 503: busy")})
    first_try = Run()
    with pytest.raises(ServerUnavailable):
        generate(conversation, client, first_try)
    # The task takes back only the failed reply's tokens: the first reply stays counted.
    assert first_try.kept_calls == 1
    assert first_try.live == len(ScriptedClient.reply_for(client.prompts[1])) - CHUNK
    assert conversation.kept_tokens == len(ScriptedClient.reply_for(client.prompts[0]))

    gen = generate(conversation, client, Run())

    assert client.prompts[2] == client.prompts[1]  # the second reply again, not the first
    assert len(client.prompts) == 4
    assert len(gen.turns) == 3  # type: ignore[attr-defined]


def test_a_later_prompt_the_server_refuses_ends_the_conversation_with_its_replies(
    tokenizer_dir: Path,
) -> None:
    conversation = Conversation.of(sample_of(tokenizer_dir), spec_of(tokenizer_dir), "ds")
    assert conversation is not None
    client = ScriptedClient(fail={2: RequestRejected("HTTP 400: The input (99 tokens) is longer than ...")})

    gen = generate(conversation, client, Run())

    assert isinstance(gen, ConversationGeneration)
    assert len(gen.turns) == 2
    assert gen.ended_early == "reply 3: HTTP 400: The input (99 tokens) is longer than ..."
    assert record_fields({}, gen)["ended_early"] == gen.ended_early


def test_a_4xx_on_the_first_reply_fails_the_sample_as_usual(tokenizer_dir: Path) -> None:
    conversation = Conversation.of(sample_of(tokenizer_dir), spec_of(tokenizer_dir), "ds")
    assert conversation is not None
    with pytest.raises(RequestRejected):
        generate(conversation, ScriptedClient(fail={0: RequestRejected("HTTP 400: no")}), Run())


def test_a_stop_returns_the_partial_reply_without_keeping_it(tokenizer_dir: Path) -> None:
    conversation = Conversation.of(sample_of(tokenizer_dir), spec_of(tokenizer_dir), "ds")
    assert conversation is not None
    run = Run(stop_after=8)  # the first reply is 6 tokens; the second is cut after 2 more

    gen = generate(conversation, ScriptedClient(), run)

    assert isinstance(gen, ConversationGeneration)
    assert gen.stopped_by_us
    assert [len(t["output_ids"]) for t in gen.turns] == [6, 2]
    assert gen.completion_tokens == 8
    assert conversation.kept_tokens == 6


def test_a_budget_reached_between_replies_ends_the_conversation_there(tokenizer_dir: Path) -> None:
    conversation = Conversation.of(sample_of(tokenizer_dir), spec_of(tokenizer_dir), "ds")
    assert conversation is not None
    run = Run(stop_after=6)  # reached by the first reply's last chunk, reported once the reply is done
    client = ScriptedClient()

    gen = generate(conversation, client, run)

    assert isinstance(gen, ConversationGeneration)
    assert len(client.prompts) == 1
    assert [len(t["output_ids"]) for t in gen.turns] == [6]
    assert (gen.completion_tokens, run.total, gen.stopped_by_us) == (6, 6, False)


class Budget:
    """The ledger's side of ``Conversation.more``: each ask's tokens wanted, answered with the grant in all
    ``give`` says (the grant before it, ``cap``, and the tokens wanted -> the grant after)."""

    def __init__(self, conversation: Conversation, give: Callable[[int, int], int]) -> None:
        self.conversation, self.give = conversation, give
        self.asks: list[int] = []

    def more(self, wanted: int) -> int:
        self.asks.append(wanted)
        return self.give(self.conversation.cap, wanted)


def granted(tokenizer_dir: Path, cap: int, give: Callable[[int, int], int]) -> tuple[Conversation, Budget]:
    """A conversation of three replies granted ``cap`` tokens of a truncate budget, wanting 128 a reply."""
    conversation = Conversation.of(sample_of(tokenizer_dir), spec_of(tokenizer_dir), "ds")
    assert conversation is not None
    conversation.cap, conversation.want = cap, 3 * 128
    budget = Budget(conversation, give)
    conversation.more = budget.more
    return conversation, budget


def test_a_reply_that_reaches_the_conversations_grant_goes_on_from_its_ids_where_the_budget_gives_more(
    tokenizer_dir: Path,
) -> None:
    conversation, budget = granted(tokenizer_dir, 4, lambda cap, wanted: cap + 100)
    client = ScriptedClient()

    gen = generate(conversation, client, Run())

    assert isinstance(gen, ConversationGeneration)
    # the first reply (6 tokens) was sent with the 4 granted, then went on with the prompt and those 4
    first_part = ScriptedClient.reply_for(client.prompts[0])[:4]
    assert client.prompts[1] == client.prompts[0] + first_part
    assert gen.turns[0]["output_ids"] == first_part + ScriptedClient.reply_for(client.prompts[1])
    assert budget.asks == [3 * 128 - 4]  # once, for what the conversation may still want
    assert conversation.cap == 104
    assert len(gen.turns) == 3 and not gen.cut_by_cap and gen.ended_early is None
    assert gen.completion_tokens == sum(len(t["output_ids"]) for t in gen.turns) <= 104
    assert requests_taken(gen) == 4  # three replies, the first in two requests


def test_a_reply_that_reaches_the_grant_where_the_budget_has_no_more_ends_the_conversation_cut(
    tokenizer_dir: Path,
) -> None:
    conversation, budget = granted(tokenizer_dir, 4, lambda cap, wanted: cap)
    client = ScriptedClient()

    gen = generate(conversation, client, Run())

    assert isinstance(gen, ConversationGeneration)
    assert len(client.prompts) == 1 and budget.asks == [3 * 128 - 4]
    assert [len(t["output_ids"]) for t in gen.turns] == [4]
    assert gen.cut_by_cap and not conversation.lost


def test_a_conversation_whose_lease_is_lost_when_it_asks_for_more_says_so_and_sends_nothing_more(
    tokenizer_dir: Path,
) -> None:
    conversation, _ = granted(tokenizer_dir, 4, lambda cap, wanted: 0)
    client = ScriptedClient()

    gen = generate(conversation, client, Run())

    assert isinstance(gen, ConversationGeneration)
    assert len(client.prompts) == 1
    assert conversation.lost and not gen.cut_by_cap


def test_a_reply_ended_exactly_at_the_grant_asks_for_more_before_the_next_reply(tokenizer_dir: Path) -> None:
    # the first reply is 6 tokens: granted 6, it ends whole at the grant, and the second needs more
    conversation, budget = granted(tokenizer_dir, 6, lambda cap, wanted: cap + 20)
    client = ScriptedClient()

    gen = generate(conversation, client, Run())

    assert isinstance(gen, ConversationGeneration)
    assert len(gen.turns) == 3 and not gen.cut_by_cap
    assert budget.asks[0] == 3 * 128 - 6
    assert client.prompts[1] != client.prompts[0] + ScriptedClient.reply_for(client.prompts[0])


def test_a_template_that_rewrites_history_marks_earlier_replies_as_not_in_context(tmp_path: Path) -> None:
    # Earlier assistant turns are rendered as a fixed word, as templates that drop reasoning do.
    rewriting = CHATML.replace(
        "{{ m['content'] }}", "{{ 'w0' if m['role'] == 'assistant' else m['content'] }}"
    )
    folder = make_chat_tokenizer(tmp_path / "rewriting", chat_template=rewriting)
    conversation = Conversation.of(sample_of(folder), spec_of(folder), "ds")
    assert conversation is not None

    gen = generate(conversation, ScriptedClient(), Run())

    assert [t["in_context"] for t in gen.turns] == [False, False, True]  # type: ignore[attr-defined]


def test_a_sample_with_one_reply_is_an_ordinary_generation(tokenizer_dir: Path) -> None:
    one = sample_of(tokenizer_dir, TURNS[:2])
    assert Conversation.of(one, spec_of(tokenizer_dir), "ds") is None
    assert Conversation.of({"input_ids": [1, 2]}, DatasetSpec((), ""), "ds") is None


def test_a_worker_without_the_tokenizer_fails_the_sample_with_a_clear_reason(tokenizer_dir: Path) -> None:
    conversation = Conversation.of(sample_of(tokenizer_dir), spec_of(Path("/nowhere/tok")), "ds")
    assert conversation is not None
    with pytest.raises(
        ConversationError, match=r"^on this worker: tokenizer '/nowhere/tok' cannot be loaded"
    ):
        generate(conversation, ScriptedClient(), Run())


class ThinkingClient(ScriptedClient):
    """A ScriptedClient whose server reports ``3 + i`` reasoning tokens for reply ``i``."""

    def generate(self, server: str, **kwargs: Any) -> Generation:
        call = len(self.prompts)
        gen = super().generate(server, **kwargs)
        gen.meta_info = {"reasoning_tokens": 3 + call}
        return gen


def test_a_conversations_reasoning_tokens_are_each_replys_added_up(tokenizer_dir: Path) -> None:
    conversation = Conversation.of(sample_of(tokenizer_dir), spec_of(tokenizer_dir), "ds")
    assert conversation is not None

    gen = generate(conversation, ThinkingClient(), Run())

    assert isinstance(gen, ConversationGeneration)
    assert [t["reasoning_tokens"] for t in gen.turns] == [3, 4, 5]
    assert gen.reasoning_tokens == 12
    assert gen.meta_info["reasoning_tokens"] == 5  # the last reply's own, as its server said
