"""Grants of a token budget, asked as a generation runs, and a generation continued past its grant.

Under a truncate budget a generation is granted its tokens of the budget when it has a server slot and is
about to be sent (``Grants.start``; ``budget/lua/_lib.lua``, "Reservations"): far from the budget's end its
whole ``max_new_tokens``, nearer the tokens every generation running may still have before the budget is
spent (the horizon). The request is sent with ``max_new_tokens`` equal to its grant, so the server stops it
there and the budget holds whatever the load: no abort has to land in time. A generation that ends before
its grant gives the rest back at once (``Grants.end``), before its slot goes to the next generation, which
is granted from it. A request that ends at its grant (finish reason ``length`` at exactly the tokens it was
sent with) while the generation may want more asks for more (``Grants.more``) and, when granted, goes on in
a new request to the same server: the prompt followed by the output so far, as ``input_ids``, with
``max_new_tokens`` the new grant. SGLang's radix cache holds that prefix (the request that just ended wrote
it), so the continuation is a cache hit and costs about one decode step; the model sees the same context
it would have had in one request, so the answer is drawn from the same distribution (and is the same under
greedy decoding: the conformance suite checks it on the real server). Where the budget has nothing more to
give, the answer ends at its grant: cut. The asks of a process's threads that come together share one
ledger call per dataset.

A sample whose prompt is exact token ids is continued with them; a text prompt with the ids the server's
``/tokenize`` gives for it (``SampleRunner._prompt_ids``, checked against the prompt's length the first
request reported). A conversation of several replies asks for more for the whole conversation and
continues the reply its grant ended the same way (``workers/conversation.py``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Final

from budget import GrantAsk, GrantKind, Ledger
from budget.ledger import GRANT_WAIT
from workers.batching import CallBatcher
from workers.sglang.client import Generation

#: The ``meta_info`` field where a continued generation says how many requests it took.
REQUESTS_FIELD: Final = "tf_requests"
#: A generation that reached its grant when nothing was left, while a few others of its dataset still run
#: (they may end before their grants and give the rest back: ``MORE_WAIT_RUNNING`` in
#: ``budget/lua/_lib.lua``), asks again this often, for at most ``MORE_WAIT_MAX_S``; then its answer ends
#: at its grant, cut. It holds its server slot meanwhile (its continuation goes to the same server), and
#: sends nothing.
MORE_WAIT_S: Final = 0.02
MORE_WAIT_MAX_S: Final = 1.0


class Grants:
    """One per worker process: a truncate budget's grants (``Ledger.grant_many``), the asks of its threads
    that come together answered by one ledger call per dataset."""

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        self._batcher: CallBatcher[str, GrantAsk, int] = CallBatcher("grants", self._grant)
        #: The slots of each dataset's servers, as its spec gives them (0: unknown).
        self._slots: dict[str, int] = {}

    def _grant(self, dataset: str, asks: Sequence[GrantAsk]) -> list[int]:
        return self._ledger.grant_many(dataset, asks, self._slots.get(dataset, 0))

    def start(self, dataset: str, sample_id: str, attempt: str, want: int, slots: int, whole: bool) -> int:
        """The first grant of a generation that has its server slot (``whole``: it cannot be continued past
        a grant): > 0; ``GRANT_NOT_NOW`` or ``GRANT_WAIT`` when none now, ``GRANT_DROPPED`` when the budget's
        end has come and the ledger gave the sample back; 0 when the attempt lost its lease."""
        self._slots[dataset] = slots
        kind = GrantKind.WHOLE if whole else GrantKind.START
        return self._batcher.call(dataset, GrantAsk(sample_id, attempt, kind, want))

    def more(self, dataset: str, sample_id: str, attempt: str, more: int) -> int:
        """The generation's grant in all after asking up to ``more`` tokens more (it reached its grant): the
        same when the budget has none to give, 0 when the attempt lost its lease. Where the ledger says to
        wait for what the few generations still running give back, it asks again every ``MORE_WAIT_S`` for
        up to ``MORE_WAIT_MAX_S``, and then once for nothing more: the grant as it stands."""
        got = self._batcher.call(dataset, GrantAsk(sample_id, attempt, GrantKind.MORE, more))
        deadline = time.monotonic() + MORE_WAIT_MAX_S
        while got == GRANT_WAIT:
            if time.monotonic() >= deadline:
                more = 0
            else:
                time.sleep(MORE_WAIT_S)
            got = self._batcher.call(dataset, GrantAsk(sample_id, attempt, GrantKind.MORE, more))
        return got

    def end(self, dataset: str, sample_id: str, attempt: str, tokens: int) -> None:
        """The generation ended with ``tokens`` in all, before its grant: the rest goes back, in order
        before any ask this process makes after (its slot's next generation is granted from it), without
        waiting for the answer (its commit finds a lost lease)."""
        self._batcher.post(dataset, GrantAsk(sample_id, attempt, GrantKind.END, tokens))


def can_continue(sample: Mapping[str, Any]) -> bool:
    """Whether a generation of ``sample`` can go on past a grant in a new request whatever its server: its
    prompt is ids (a conversation's replies are each continued from their templated ids)."""
    return bool(sample.get("input_ids"))


def ended_at_grant(gen: Generation, sent_max_new: int) -> bool:
    """Whether the request ended because it reached the ``max_new_tokens`` it was sent with: the grant,
    not the answer, ended it. A ``length`` finish short of it (the server clamped it to the context) is an
    answer's end."""
    reason = gen.finish_reason or {}
    return (
        not gen.aborted
        and not gen.stopped_by_us
        and reason.get("type") == "length"
        and gen.completion_tokens >= sent_max_new > 0
    )


def requests_taken(gen: Generation) -> int:
    """The server requests ``gen`` took: one per grant of a continued generation (``joined`` counts them;
    a conversation adds up its replies' counts), one per reply of a conversation that has no count, else
    one. A record carries it as ``requests``."""
    counted = gen.meta_info.get(REQUESTS_FIELD)
    if counted:
        return int(counted)
    turns = getattr(gen, "turns", None)
    if isinstance(turns, list) and turns:
        return len(turns)
    return 1


def continued_prompt(prompt_ids: Sequence[int], so_far: Generation) -> list[int]:
    """What a continuation sends as ``input_ids``: the prompt, then every token generated so far."""
    return [*prompt_ids, *so_far.output_ids]


def joined(so_far: Generation, part: Generation) -> Generation:
    """The generation as one: ``so_far`` followed by ``part``, the continuation's request. The ids and text
    are concatenated, the finish is the part's (a ``length`` finish at the generation's length), the
    prompt is the original one, and the counts add up."""
    meta = dict(part.meta_info)
    requests = int(so_far.meta_info.get(REQUESTS_FIELD) or 1) + 1
    completion = so_far.completion_tokens + part.completion_tokens
    reasoning = int(so_far.meta_info.get("reasoning_tokens") or 0) + int(
        part.meta_info.get("reasoning_tokens") or 0
    )
    meta.update(
        {
            REQUESTS_FIELD: requests,
            "prompt_tokens": so_far.prompt_tokens,
            "completion_tokens": completion,
            "reasoning_tokens": reasoning,
        }
    )
    reason = part.finish_reason
    if reason and reason.get("type") == "length" and isinstance(reason.get("length"), int):
        # the length it ended at is the generation's, not the last request's max_new_tokens
        reason = {**reason, "length": so_far.completion_tokens + int(reason["length"])}
    return replace(
        part,
        rid=so_far.rid,
        finish_reason=reason,
        output_ids=[*so_far.output_ids, *part.output_ids],
        text=so_far.text + part.text,
        prompt_tokens=so_far.prompt_tokens,
        completion_tokens=completion,
        meta_info=meta,
    )
