"""A generation's grant of its dataset's token budget, kept on its own stream.

Under a token budget (policy truncate or discard) the ledger gives each admitted generation a grant: tokens
of the budget reserved for it (``budget/lua/_lib.lua``, "Reservations"). Its request is sent with the
dataset's whole ``max_new_tokens``, so a server slot is never held back for the budget; the stream itself
is watched against the grant, with no ledger call per chunk:

- **Ask ahead.** When the stream comes within ``ahead`` tokens of its grant, the worker asks the ledger for
  more (``Ledger.extend_many``: the asks of a process's threads that come together share one call). Far
  from the budget's end a grant is the whole ``max_new_tokens`` and nothing is ever asked.
- **Stop at the grant.** Where the budget has nothing more to give, the stream is stopped before its next
  chunk could pass the grant, with the lag the process measured (``GrantExtender.stopped``: how far
  stopped streams went past their grants, a busy reader being behind the server): its rid is aborted, and
  the server ends it after one more decode step (``ABORT_LAG_TOKENS`` at least). Under truncate the
  answer is kept, cut; under discard it is thrown away.
- **Chunks often enough to see it.** A stream whose grant is less than it may want asks for a chunk every
  sixteenth of its grant (at least ``INTERVAL_MIN`` tokens, at most the pacer's interval), so the stop lands
  within a few tokens of the grant.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from budget import Ledger
from workers.batching import CallBatcher

#: Tokens a server still generates after we decide to stop a stream: one decode step after the abort
#: lands, and one for the abort's own round trip.
ABORT_LAG_TOKENS: Final = 2
#: The least ``stream_interval`` a grant-watched stream asks for.
INTERVAL_MIN: Final = 8
#: A grant-watched stream asks for a chunk every this fraction of its grant.
INTERVAL_SHARE: Final = 4
#: Ask for more at least this many tokens before the grant.
AHEAD_MIN: Final = 32

#: One ask: (sample_id, attempt, more, least).
Ask = tuple[str, str, int, int]


#: The most a stream's stop is moved ahead of its grant for the streams' measured lag.
LAG_MAX_TOKENS: Final = 256


class GrantExtender:
    """One per worker process: the asks for more of a budget, grouped into one ledger call per dataset;
    and how far ahead of its grant a stream must stop (``lag_tokens``): the server generates on while this
    process reads its chunks and sends the abort, longer when it is busy, so a stop is moved ahead by what
    the streams stopped so far went past their grants."""

    def __init__(self, ledger: Ledger) -> None:
        self._batcher: CallBatcher[str, Ask, int] = CallBatcher("extender", self._extend)
        self._ledger = ledger
        self.lag_tokens = float(ABORT_LAG_TOKENS)

    def stopped(self, granted: int, generated: int) -> None:
        """A stream stopped at its grant of ``granted`` tokens ended with ``generated``: one that passed its
        grant moves every stop ahead by as much (the server went on while this process read and aborted);
        one that did not lets the stop back by a token, down to the abort's own lag. A stop before the
        grant wastes nothing (what is left goes back to the budget), one past it is GPU time past the
        budget: the lag rises at once and falls slowly."""
        lag = self.lag_tokens + (generated - granted) if generated > granted else self.lag_tokens - 1
        self.lag_tokens = min(float(LAG_MAX_TOKENS), max(float(ABORT_LAG_TOKENS), lag))

    def _extend(self, dataset: str, asks: Sequence[Ask]) -> list[int]:
        return self._ledger.extend_many(dataset, asks)

    def extend(self, dataset: str, sample_id: str, attempt: str, more: int, least: int) -> int:
        """The generation's grant after asking ``more``, ``least`` the fewest worth having (unchanged:
        nothing to give now; 0: lease lost)."""
        return self._batcher.call(dataset, (sample_id, attempt, more, least), hurry=True)


def watched_interval(granted: int, paced: int) -> int:
    """The ``stream_interval`` for a stream whose grant is ``granted`` tokens, the pacer asking ``paced``."""
    return max(INTERVAL_MIN, min(paced, granted // INTERVAL_SHARE))


class GrantWatch:
    """One generation's grant, checked at each of its stream's chunks (from the stream's own thread)."""

    __slots__ = (
        "_asked_at",
        "_extender",
        "_last_word_at",
        "attempt",
        "dataset",
        "granted",
        "interval",
        "lost",
        "sample_id",
        "want",
    )

    def __init__(
        self,
        extender: GrantExtender,
        dataset: str,
        sample_id: str,
        attempt: str,
        *,
        granted: int,
        want: int,
        interval: int,
    ) -> None:
        self._extender = extender
        self.dataset, self.sample_id, self.attempt = dataset, sample_id, attempt
        #: Tokens of the budget this generation holds; ``want``: the most it may produce.
        self.granted = granted
        self.want = want
        #: The stream's chunk interval in tokens (a chunk may bring this many at once).
        self.interval = interval
        #: Set when an ask found the lease taken back.
        self.lost = False
        #: The grant when we last asked ahead, and when we last asked at the stop: one ask of each per grant.
        self._asked_at = -1
        self._last_word_at = -1

    @property
    def limited(self) -> bool:
        """Whether the grant may end the generation before its own ``max_new_tokens``."""
        return self.granted < self.want

    def allows(self, produced: int) -> bool:
        """Whether the stream may go on, ``produced`` tokens in: asks for more a chunk before it must stop,
        and says no where the next chunks (and the abort's lag) could pass what it holds."""
        if not self.limited:
            return True
        if (
            produced + self.margin + max(AHEAD_MIN, self.interval) >= self.granted
            and self._asked_at != self.granted
        ):
            self._ask(produced)
        if self._stops_at(produced) and self._last_word_at != self.granted:
            # one more ask before it stops: another generation may have given tokens back since
            self._last_word_at = self.granted
            self._ask(produced)
        return not self.lost and not self._stops_at(produced)

    @property
    def margin(self) -> int:
        """How far before its grant the stream stops: the next chunk, and the lag measured
        (``GrantExtender.stopped``: the abort's, and what a reader busy with many streams has not read)."""
        return self.interval + round(self._extender.lag_tokens)

    def _stops_at(self, produced: int) -> bool:
        return self.limited and produced + self.margin > self.granted

    def _ask(self, produced: int) -> None:
        if self.lost:
            return
        before = self.granted
        self._asked_at = before
        # less than would carry the stream a chunk past its stop point would not keep it going
        least = produced + self.margin + self.interval - before
        after = self._extender.extend(self.dataset, self.sample_id, self.attempt, self.want - before, least)
        if after <= 0:
            self.lost = True
        else:
            self.granted = max(before, after)
