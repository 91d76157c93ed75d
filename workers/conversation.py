"""A sample of several replies (``regenerate = "all"``): one ``/generate`` per reply, in order.

The producer plans the conversation (`chat.templates.plan_conversation`) and tokenizes the first reply's
prompt; each later prompt is the chat template rendered over the turns so far, with the replies generated
before it as their text (decoded from their exact ids), so the server sees what the trainer will see when
it templates the exported conversation.

Every reply streams through the task's ``on_tokens``, so budgets, stops and truncation work as for one
generation. A finished reply is kept: a retry (a 5xx, a dropped stream, a server-side abort) resumes at the
reply that failed, and ``keep_turn`` tells the task that the tokens counted so far are no longer in the
air. When a later reply's prompt no longer fits the server (a 4xx), the conversation ends with the replies
it has; a 4xx on the first reply fails the sample as usual.

The result is one `ConversationGeneration`: the last reply as a `Generation` (its ids, finish reason,
prompt length), ``completion_tokens`` over every reply (what the ledger counted), and each reply's exact
``output_ids`` in ``turns``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from budget.spec import DatasetSpec
from budget.urls import redact_url
from chat.templates import ChatError, ChatTokenizer, count_replies, load_chat_tokenizer, prompt_messages
from workers.continuation import (
    REQUESTS_FIELD,
    continued_prompt,
    ended_at_grant,
    joined,
    requests_taken,
)
from workers.rids import new_rid
from workers.sglang.client import (
    Generation,
    OnTokens,
    ProtocolError,
    RequestRejected,
    SGLangClient,
    StopHandle,
)
from workers.sglang.protocol import SGLANG_DEFAULT_MAX_NEW_TOKENS

__all__ = ["Conversation", "ConversationError", "ConversationGeneration", "record_fields"]

#: Generates one reply: the `SGLangClient.generate` signature.
GenerateFn = Callable[..., Generation]


def several_replies(sample: Mapping[str, Any]) -> bool:
    """Whether ``sample`` is a conversation that generates more than one reply (``Conversation``)."""
    conversation = sample.get("conversation")
    if not conversation or sample.get("input_ids") is None:
        return False
    return count_replies(conversation) >= 2


class ConversationError(ProtocolError):
    """This worker cannot continue the conversation (its tokenizer cannot be loaded): the sample fails."""


@dataclass(slots=True)
class ConversationGeneration(Generation):
    """The last reply of a conversation, with every reply in ``turns``."""

    #: One dict per generated reply: ``prompt_tokens``, ``output_ids``, ``content``, ``finish_reason``,
    #: ``completion_tokens``, ``reasoning_tokens``, ``rid``, ``server``, ``in_context``.
    turns: list[dict[str, Any]] = field(default_factory=list)
    #: The last reply's prompt: the whole conversation before it, as the server saw it.
    prompt_ids: list[int] = field(default_factory=list)
    #: Why the conversation ended before its last reply (a prompt the server refused), or None.
    ended_early: str | None = None
    #: The token budget's reservation for the sample ran out before its last reply ended: cut at the budget.
    cut_by_cap: bool = False

    @property
    def reasoning_tokens(self) -> int:
        """Thinking tokens over every reply (each reply's as its server reported them)."""
        return sum(int(t.get("reasoning_tokens") or 0) for t in self.turns)


class Conversation:
    """The replies of one sample, generated in order and kept across the task's retries."""

    def __init__(self, sample: Mapping[str, Any], spec: DatasetSpec, dataset: str) -> None:
        self.conversation: list[dict[str, Any]] = list(sample["conversation"])
        self.replies = count_replies(self.conversation)
        self.first_prompt: list[int] = list(sample["input_ids"])
        self.tokenizer_name: str | None = spec.tokenizer
        self.dataset = dataset
        #: Kept replies and their prompts.
        self.generations: list[Generation] = []
        self.prompts: list[list[int]] = []
        self.contents: list[str] = []
        #: The token budget's grant for every reply together (0: none): each request is sent with
        #: ``max_new_tokens`` at most what is left of it.
        self.cap = 0
        #: Asks the budget for more for the whole conversation (truncate, granted at send time), given the
        #: tokens it may still want: returns the grant in all after the ask (no more than ``cap``: the budget
        #: has none to give; 0 or less: the lease is lost). None: a reply that reaches ``cap`` ends the
        #: conversation there, cut.
        self.more: Callable[[int], int] | None = None
        #: The most tokens every reply together may produce (its grant's want: what ``more`` asks up to).
        self.want = 0
        #: The lease was found lost when asking for more: nothing of this attempt may be kept.
        self.lost = False

    @classmethod
    def of(cls, sample: Mapping[str, Any], spec: DatasetSpec, dataset: str) -> Conversation | None:
        """A conversation when the sample has more than one reply to generate; None otherwise (one reply is
        one ordinary generation of the sample's ``input_ids``)."""
        if not several_replies(sample):
            return None
        return cls(sample, spec, dataset)

    @property
    def kept_tokens(self) -> int:
        return sum(g.completion_tokens for g in self.generations)

    def generator(self, client: SGLangClient, keep_turn: Callable[[], None]) -> GenerateFn:
        """A stand-in for ``client.generate`` that generates the replies not generated yet."""

        def generate(
            server: str,
            *,
            rid: str,
            sampling_params: dict[str, Any],
            timeout_s: float,
            on_tokens: OnTokens,
            stop: StopHandle | None = None,
            stall_timeout_s: float | None = None,
            **_prompt: Any,
        ) -> Generation:
            return self._generate(
                client, server, rid, sampling_params, timeout_s, on_tokens, keep_turn, stop, stall_timeout_s
            )

        return generate

    def _tokenizer(self) -> ChatTokenizer:
        if not self.tokenizer_name:
            raise ConversationError("a conversation of several replies needs the dataset's tokenizer")
        try:
            return load_chat_tokenizer(self.tokenizer_name)
        except ChatError as e:
            raise ConversationError(f"on this worker: {e}") from None

    def _generate(
        self,
        client: SGLangClient,
        server: str,
        rid: str,
        sampling_params: dict[str, Any],
        timeout_s: float,
        on_tokens: OnTokens,
        keep_turn: Callable[[], None],
        stop: StopHandle | None = None,
        stall_timeout_s: float | None = None,
    ) -> Generation:
        chat = self._tokenizer()
        reply_max = int(sampling_params.get("max_new_tokens") or 0) or SGLANG_DEFAULT_MAX_NEW_TOKENS
        while len(self.generations) < self.replies:
            reply = len(self.generations)
            if self.cap and self.cap <= self.kept_tokens and not self._grown():
                if self.lost:
                    return self._result(chat, ended_early=f"reply {reply + 1}: the lease was lost")
                return self._result(chat, ended_early=f"reply {reply + 1}: the token budget is reached")
            if reply == 0:
                prompt = self.first_prompt
            else:
                try:
                    prompt = chat.prompt_ids(prompt_messages(self.conversation, reply, self.contents))
                except ValueError as e:
                    return self._result(chat, ended_early=f"reply {reply + 1}: {e}")
            reported = 0

            def counted(n: int) -> bool:
                nonlocal reported
                reported += n
                return on_tokens(n)

            def send(ids: list[int], rid: str, so_far: int) -> tuple[Generation, int]:
                """One request of the reply, ``so_far`` of its tokens generated before it: the reply's
                max_new_tokens, or what is left of the budget's grant where that is less (then also the
                number sent; else 0)."""
                params, capped = sampling_params, 0
                left = self.cap - self.kept_tokens - so_far
                if self.cap and left < reply_max - so_far:
                    params, capped = {**sampling_params, "max_new_tokens": left}, left
                elif so_far:
                    params = {**sampling_params, "max_new_tokens": reply_max - so_far}
                gen = client.generate(
                    server,
                    rid=rid,
                    sampling_params=params,
                    input_ids=ids,
                    timeout_s=timeout_s,
                    on_tokens=counted,
                    stop=stop,
                    stall_timeout_s=stall_timeout_s,
                )
                return gen, capped

            try:
                gen, capped = send(prompt, rid, 0)
                last = gen
                # the grant ended the reply, not its max_new_tokens: it goes on where the budget gives
                # more, the prompt and the reply so far sent again (a prefix-cache hit), as a generation
                # of one reply does (workers/continuation.py)
                while capped and ended_at_grant(last, capped) and self._grown():
                    more_rid = new_rid(self.dataset)
                    last, capped = send(continued_prompt(prompt, gen), more_rid, gen.completion_tokens)
                    gen = joined(gen, last)
            except RequestRejected as e:
                if reply == 0:
                    raise
                # The conversation grew past what the server takes: keep what it has.
                return self._result(chat, ended_early=f"reply {reply + 1}: {e.message}")
            rid = new_rid(self.dataset)
            if gen.stopped_by_us or gen.aborted:
                # Cut by us (budget, revoke, lost lease) or by the server: the task decides; the partial
                # reply is in the result but not kept, so a retry generates it again.
                return self._result(chat, partial=(prompt, gen))
            self.generations.append(gen)
            self.prompts.append(prompt)
            self.contents.append(chat.reply_text(gen.output_ids, gen.finish_reason))
            # The client does not report a stream's last chunk: count it before the next reply.
            unreported = gen.completion_tokens - reported
            if reply + 1 < self.replies and unreported > 0 and not on_tokens(unreported):
                return self._result(chat)
            if self.lost:
                return self._result(chat, ended_early=f"reply {reply + 1}: the lease was lost")
            if capped and ended_at_grant(last, capped):
                # the budget has no more to give: the conversation ends at it
                return self._result(chat, ended_early=f"reply {reply + 1}: cut at the token budget")
            keep_turn()
        return self._result(chat)

    def _grown(self) -> bool:
        """Whether the budget granted the conversation more (``more``): it reached its grant."""
        if self.more is None:
            return False
        after = self.more(self.want - self.cap) if self.want > self.cap else self.cap
        if after <= 0:
            self.lost = True
            return False
        if after <= self.cap:
            return False
        self.cap = after
        return True

    def _result(
        self,
        chat: ChatTokenizer,
        partial: tuple[list[int], Generation] | None = None,
        ended_early: str | None = None,
    ) -> ConversationGeneration:
        gens, prompts, contents = list(self.generations), list(self.prompts), list(self.contents)
        if partial is not None:
            prompts.append(partial[0])
            gens.append(partial[1])
            contents.append(chat.reply_text(partial[1].output_ids, partial[1].finish_reason))
        last, last_prompt = gens[-1], prompts[-1]
        turns = [
            {
                "prompt_tokens": len(prompt),
                "output_ids": g.output_ids,
                "content": content,
                "finish_reason": g.finish_reason,
                "completion_tokens": g.completion_tokens,
                "reasoning_tokens": g.reasoning_tokens,
                "rid": g.rid,
                "server": redact_url(g.server),
                "in_context": _in_context(prompts, gens, i),
            }
            for i, (prompt, g, content) in enumerate(zip(prompts, gens, contents, strict=True))
        ]
        return ConversationGeneration(
            rid=last.rid,
            server=last.server,
            output_ids=last.output_ids,
            text=last.text,
            finish_reason=last.finish_reason,
            prompt_tokens=len(last_prompt),
            completion_tokens=sum(g.completion_tokens for g in gens),
            # a continued reply took more than one request
            meta_info={**last.meta_info, REQUESTS_FIELD: sum(requests_taken(g) for g in gens)},
            stopped_by_us=last.stopped_by_us,
            turns=turns,
            prompt_ids=last_prompt,
            ended_early=ended_early,
            cut_by_cap=bool(ended_early and "token budget" in ended_early),
        )


def _in_context(prompts: list[list[int]], gens: list[Generation], i: int) -> bool:
    """Whether reply ``i``'s exact ids stand at its place in the last prompt + output: every later prompt
    starts with the one before it and that reply's ids. False where the template re-tokenized a reply
    differently or rewrote the history (some templates drop earlier reasoning)."""
    for j in range(i, len(prompts) - 1):
        head = prompts[j] + gens[j].output_ids
        if prompts[j + 1][: len(head)] != head:
            return False
    return True


def record_fields(sample: Mapping[str, Any], gen: Generation) -> dict[str, Any]:
    """What a record adds for a chat sample: its ``conversation`` and, for several replies, the last
    prompt as ``input_ids`` and each reply in ``turns``."""
    fields: dict[str, Any] = {}
    if sample.get("conversation") is not None:
        fields["conversation"] = sample["conversation"]
    if isinstance(gen, ConversationGeneration):
        fields["input_ids"] = gen.prompt_ids
        fields["turns"] = gen.turns
        if gen.ended_early:
            fields["ended_early"] = gen.ended_early
    return fields
