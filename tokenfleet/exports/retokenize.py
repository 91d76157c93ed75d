"""What a text export loses: the replies whose text does not come back as the generated ids.

A trainer that loads a conversation row (SpecForge's raw-data path, EAGLE's ``ge_data`` scripts) renders it
with the chat template and tokenizes the whole text again. A reply's text is its exact ids decoded, but
decoding is not always undone by encoding: a byte of a multi-byte character decodes to U+FFFD and encodes as
other tokens, the tokenizer merges an unusual split into one token, a reply that starts with whitespace
merges with the template's header before it. This module renders each reply the way the trainer does and
says, per reply, whether the tokens the trainer trains on are the ones the model generated, and where they
part.

For reply ``k`` of a row: ``P`` is the template rendered over the turns before it with the generation prompt
(what the model was prompted with), ``F`` the template rendered through the reply. The trainer sees the
ids of ``F``; they must start with the ids of ``P`` (else the reply merged into the prompt), equal the
prompt the model saw where the record has it (else the row's prompt is not the model's), and continue
with the reply's generated ids (without the stop token that ended it, which the text leaves out too).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["ChatRenderer", "Mismatch", "check_row", "content_ids"]


class ChatRenderer(Protocol):
    """What the check needs of the dataset's tokenizer (`chat.templates.ChatTokenizer` has it)."""

    def render(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str: ...

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class Mismatch:
    """One reply whose text does not re-tokenize to its generated ids."""

    id: str
    #: 1-based, among the row's replies.
    reply: int
    #: ``prompt`` (the row renders a prompt the model did not see), ``boundary`` (the reply's first tokens
    #: merge with the text before it) or ``reply`` (the reply's own tokens differ).
    where: str
    #: The first differing token, counted from the start of the prompt or of the reply.
    token: int

    def describe(self) -> str:
        return f"{self.id} reply {self.reply}: {self.where} token {self.token}"


def content_ids(output_ids: Sequence[int], finish_reason: Mapping[str, Any] | None) -> list[int]:
    """The generated ids a reply's text stands for: without the stop token that ended it."""
    ids = list(output_ids)
    finish = finish_reason or {}
    matched = finish.get("matched") if finish.get("type") == "stop" else None
    if isinstance(matched, int) and not isinstance(matched, bool) and ids and ids[-1] == matched:
        ids.pop()
    return ids


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


@dataclass(frozen=True, slots=True)
class Reply:
    """A reply of a row as generated: its ids, how it ended, and its prompt when the record has it."""

    output_ids: list[int]
    finish_reason: Mapping[str, Any] | None
    prompt_ids: list[int] | None


def replies_of(record: Mapping[str, Any]) -> list[Reply]:
    """Each generated reply of a record, in order, with its exact prompt where it is on record (a single
    reply's ``input_ids``; in a conversation, the last prompt and the first ``prompt_tokens`` of it for an
    earlier reply that stands verbatim in it)."""
    prompt = record.get("input_ids")
    turns = record.get("turns")
    if not turns:
        return [Reply(list(record.get("output_ids") or []), record.get("finish_reason"), prompt)]
    out: list[Reply] = []
    last = len(turns) - 1
    for n, turn in enumerate(turns):
        known: list[int] | None = None
        if prompt is not None and n == last:
            known = list(prompt)
        elif prompt is not None and turn.get("in_context"):
            known = list(prompt[: int(turn["prompt_tokens"])])
        out.append(Reply(list(turn.get("output_ids") or []), turn.get("finish_reason"), known))
    return out


def check_row(
    chat: ChatRenderer, sid: str, conversation: Sequence[Mapping[str, str]], replies: Sequence[Reply]
) -> list[Mismatch]:
    """The replies of an exported conversation whose tokens, as the trainer makes them, are not the
    generated ones; ``replies`` pairs with the conversation's assistant turns in order."""
    found: list[Mismatch] = []
    positions = [i for i, t in enumerate(conversation) if t["role"] == "assistant"]
    for k, (pos, reply) in enumerate(zip(positions, replies, strict=False), start=1):
        before = [dict(t) for t in conversation[:pos]]
        through = [*before, dict(conversation[pos])]
        prompt_ids = chat.encode(chat.render(before, add_generation_prompt=True))
        full_ids = chat.encode(chat.render(through, add_generation_prompt=False))
        wanted = content_ids(reply.output_ids, reply.finish_reason)
        if reply.prompt_ids is not None and prompt_ids != reply.prompt_ids:
            found.append(Mismatch(sid, k, "prompt", _first_difference(prompt_ids, reply.prompt_ids)))
        elif full_ids[: len(prompt_ids)] != prompt_ids:
            found.append(Mismatch(sid, k, "boundary", _first_difference(full_ids, prompt_ids)))
        else:
            got = full_ids[len(prompt_ids) : len(prompt_ids) + len(wanted)]
            if got != wanted:
                found.append(Mismatch(sid, k, "reply", _first_difference(got, wanted)))
    return found
