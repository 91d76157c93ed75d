"""Feeds every dataset's samples into the queue, a bounded window at a time, until all are settled.

The ledger decides, atomically per batch, which samples to publish (``Ledger.enqueue``): never a done,
failed, queued or in-flight one, never more than the dataset's window, never past its sample cap, nothing
while it is paused, revoked or exhausted. Samples a worker took but gave back (dropped while paused, at a
limit, revoked then resumed, or a lease that expired after a worker died) are pending; once the dataset is
quiet the feeder takes back every expired lease itself (it does not wait for a worker to do it) and reads
the source again to feed them.

The end is the ledger's word, never the feeder's guess: a dataset is done when its snapshot is settled
(nothing queued, in flight or pending, the source read; or a limit or a revoke stopped it). A pass that
published nothing is not the end: pending samples no longer in the source (changed or removed lines) are
taken off the pending list and counted (``not_in_source``), and the next round asks the ledger again.
Any other end raises `Unsettled`, which says what is left.

A dataset a limit or a revoke stops before its pass has read the whole source still has the rest of it read,
without anything fed, a slice of each round at a time: its source is counted (``source_total``), so the
samples never fed are known. Should it be active again (a limit raised, a resume), another pass feeds them.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import orjson

from budget import DatasetSnapshot, Ledger, LedgerError, LedgerUnavailable, UnknownDataset
from budget.ledger import (
    DEFAULT_QUEUED_AUDIT_MS,
    ENQUEUE_BUDGET_IN_FLIGHT,
    ENQUEUE_NOT_ACTIVE,
    ENQUEUE_PUBLISH,
    ENQUEUE_WINDOW_FULL,
    DatasetState,
)
from producer.source import RecordReader, Rejected, Sample, iter_source

#: Tasks kept queued per dataset: enough to keep every worker thread busy, never the whole dataset.
DEFAULT_WINDOW: Final = 512
#: Samples asked about in one ledger call.
DEFAULT_BATCH: Final = 256
#: Pause between rounds when nothing could be fed.
IDLE_POLL_S: Final = 0.1
#: After a round that published nothing (the window full, or nothing to feed), the wait before the next
#: grows to this: each round reads every dataset's snapshot, a dozen Redis commands.
IDLE_POLL_MAX_S: Final = 1.0
#: ... or to this while a dataset's budget is all reserved by generations in flight: a freed reservation
#: reaches a new generation through the next round (a budget's tail runs at this pace).
BUDGET_POLL_S: Final = 0.25

#: A round spends at most this long reading on through the sources of datasets a limit or a revoke stopped
#: (counting, not feeding): the datasets still fed wait no longer than this for it.
COUNT_SLICE_S: Final = 0.05

#: A producer says it feeds each of its datasets this often (``Ledger.fed``: status tells a dataset left
#: with no producer).
FED_EVERY_S: Final = 1.0

#: Reclaim expired leases and audit queued samples this often.
AUDIT_EVERY_S: Final = 5.0
#: Wait between tries while Redis or the broker does not answer.
OUTAGE_RETRY_S: Final = 2.0

#: Give up (`Unsettled`) after this long with no progress and no worker online; 0 waits for ever.
DEFAULT_STALL_S: Final = 900.0

log = logging.getLogger(__name__)


class PublishError(Exception):
    """The broker refused a batch of tasks (it is probably restarting)."""


class Unsettled(Exception):
    """Feeding ended before every dataset settled (Ctrl-C, or no progress and no worker online)."""

    def __init__(self, reason: str, snapshots: Sequence[DatasetSnapshot]) -> None:
        super().__init__(reason)
        self.reason = reason
        self.snapshots = list(snapshots)

    def left(self) -> list[str]:
        """One line per unsettled dataset: what is left of it, and why it is not moving."""
        return [left_line(s) for s in self.snapshots if not s.settled]


def left_line(s: DatasetSnapshot) -> str:
    why = {
        "paused": "paused: `tokenfleet resume` feeds it again",
        "active": "waiting for workers" if s.queued or s.pending else "generating",
    }.get(s.state, s.state)
    if s.state == "active" and not s.source_done:
        why = "its source is not fully fed yet"
    if s.held:
        why = (
            f"{s.held:,} held: generated, their records waiting for room in the output folder "
            f"({s.output_error or 'see tokenfleet status'})"
        )
    left = s.source_total - s.samples - s.failed if s.source_done else None
    todo = f"{left:,} of {s.source_total:,} source samples not done, " if left is not None else ""
    return (
        f"{s.name}: {todo}{s.pending:,} pending, {s.inflight:,} in flight, {s.queued:,} queued "
        f"({s.samples:,} done, {s.failed:,} failed); {why}"
    )


def progress_mark(snaps: Sequence[DatasetSnapshot]) -> tuple[tuple[int, ...], ...]:
    """What changes whenever the fleet does anything for these datasets."""
    return tuple(
        (s.tokens, s.samples, s.failed, s.pending, s.queued, s.inflight, s.live_tokens, s.reclaimed)
        for s in snaps
    )


#: Publishes samples of one dataset to the queue; raises if the broker refused.
Publish = Callable[[str, Sequence[Sample]], None]


@dataclass
class DatasetFeed:
    """The feeder's view of one dataset's source."""

    name: str
    path: Path
    rejected_path: Path
    passes: int = 0
    #: Samples and rejected lines counted on the first full pass of this run.
    total: int = 0
    rejected: int = 0
    pass_complete: bool = False
    #: Samples published by the current pass.
    published_this_pass: int = 0
    #: The current pass read samples without feeding them (its dataset had stopped: they were only
    #: counted): should the dataset be fed again, another pass feeds them.
    skipped: bool = False
    #: How records become samples (format, tokenizer, context length); None: the plain line format.
    reader: RecordReader | None = None
    buffer: deque[Sample] = field(default_factory=deque)
    #: Passes after the first: ids pending when the pass started and not yet seen in the source.
    unseen_pending: set[str] = field(default_factory=set)
    #: Passes after the first: ids pending at the start that were seen in the source.
    seen_pending: set[str] = field(default_factory=set)
    _ids: set[int] = field(default_factory=set)
    _lines: Iterator[Sample | Rejected] | None = None

    def start_pass(self, pending: set[str] | None = None) -> None:
        self.passes += 1
        self.pass_complete = False
        self.published_this_pass = 0
        self.skipped = False
        self.buffer.clear()
        self.unseen_pending = set(pending or ())
        self.seen_pending = set()
        self._lines = iter_source(self.path, reader=self.reader)
        if self.passes == 1:
            self.rejected_path.parent.mkdir(parents=True, exist_ok=True)
            self.rejected_path.write_bytes(b"")

    def reset(self) -> None:
        """Forget everything this run's passes found (the ledger they were counted in is gone): the next
        round starts a first pass afresh, with no id seen yet and nothing counted, rejected or buffered."""
        self.passes, self.pass_complete, self.total, self.rejected = 0, False, 0, 0
        self.published_this_pass, self.skipped = 0, False
        self.buffer.clear()
        self.unseen_pending, self.seen_pending = set(), set()
        self._ids, self._lines = set(), None

    def take(self, n: int) -> list[Sample]:
        """Up to ``n`` samples: first those put back, then new ones from the source."""
        out: list[Sample] = []
        while self.buffer and len(out) < n:
            out.append(self.buffer.popleft())
        while len(out) < n and (sample := self._next()) is not None:
            out.append(sample)
        return out

    def skip(self, deadline: float) -> bool:
        """Read on through the pass without feeding, until the source ends or ``time.monotonic()`` reaches
        ``deadline`` (one line at least): a dataset that stopped early still has its whole source counted
        (the first pass's total and rejected lines). Returns whether the source is read to its end."""
        if self.buffer:  # counted when they were read
            self.skipped = True
            self.buffer.clear()
        # the warning about prompts sent with their ids unchecked counts those sent, not those counted
        unchecked = self.reader.unchecked if self.reader is not None else 0
        while self._lines is not None:
            if self._next() is not None:
                self.skipped = True
            if time.monotonic() >= deadline:
                break
        if self.reader is not None:
            self.reader.unchecked = unchecked
        return self._lines is None

    def _next(self) -> Sample | None:
        """The pass's next sample from the source (None at its end). The first pass counts the samples and
        rejects bad lines and repeated ids; a later one notes which pending ids the source still has."""
        while self._lines is not None:
            item = next(self._lines, None)
            if item is None:
                self._lines = None
                self._ids = set()  # only the first pass checks ids: free them
                return None
            if isinstance(item, Rejected):
                if self.passes == 1:
                    self._reject(item)
                continue
            if self.passes == 1:
                if self._seen_before(item.sample_id):
                    reason = f'duplicate id "{item.sample_id}": an earlier line has the same id'
                    self._reject(Rejected(item.line_no, reason, ""))
                    continue
                self.total += 1
            elif item.sample_id in self.unseen_pending:
                self.unseen_pending.discard(item.sample_id)
                self.seen_pending.add(item.sample_id)
            return item
        return None

    def _seen_before(self, sample_id: str) -> bool:
        """Whether an earlier line of this pass had ``sample_id`` (8-byte digests: ~50 bytes a sample)."""
        digest = int.from_bytes(hashlib.blake2b(sample_id.encode(), digest_size=8).digest(), "little")
        if digest in self._ids:
            return True
        self._ids.add(digest)
        return False

    def put_back(self, samples: Sequence[Sample]) -> None:
        self.buffer.extendleft(reversed(samples))

    @property
    def exhausted_source(self) -> bool:
        return self._lines is None and not self.buffer

    def _reject(self, item: Rejected) -> None:
        self.rejected += 1
        line = {"line": item.line_no, "reason": item.reason, "raw": item.raw}
        with self.rejected_path.open("ab") as f:
            f.write(orjson.dumps(line) + b"\n")


class Feeder:
    def __init__(
        self,
        ledger: Ledger,
        publish: Publish,
        feeds: Sequence[DatasetFeed],
        window: int = DEFAULT_WINDOW,
        batch: int = DEFAULT_BATCH,
        queue_key: str | None = None,
    ) -> None:
        self.ledger = ledger
        self.publish = publish
        self.feeds = list(feeds)
        self.window = window
        #: Samples published so far (a round that publishes none lets the next one wait longer).
        self.published = 0
        #: Whether the last round found a dataset's budget all reserved by generations in flight.
        self.budget_waiting = False
        #: The snapshots the last round read, one per dataset.
        self.last_snapshots: list[DatasetSnapshot] = []
        #: After the last round, how long until a dataset's queue is half empty at its rate (how long the
        #: next round may wait; inf: no dataset needs feeding).
        self.refill_s = math.inf
        self.batch = batch
        #: The broker's queue list: a dataset that stops (limit, revoke, pause) has its waiting messages
        #: purged from it at once instead of each being dropped by a worker.
        self.queue_key = queue_key
        #: Whether the last round left the source of a stopped dataset partly counted (the next round
        #: comes soon, to go on).
        self.counting = False
        #: When this producer last told the ledger it feeds its datasets (monotonic).
        self.fed_at = -math.inf

    def snapshots(self) -> list[DatasetSnapshot]:
        return [self.ledger.snapshot(f.name) for f in self.feeds]

    def settled(self, feed: DatasetFeed, snap: DatasetSnapshot) -> bool:
        """The ledger's word (`DatasetSnapshot.settled`), once this run has read the source to its end:
        a dataset a limit or a revoke stopped has the rest counted without being fed (so `status` can say
        how many were never fed); an active one must have been fed all of it."""
        if snap.state in (DatasetState.EXHAUSTED, DatasetState.REVOKED):
            return feed.pass_complete and snap.settled
        return feed.pass_complete and not feed.skipped and snap.settled

    def expected_end_s(self) -> float:
        """When the samples queued and in flight should all be done, at the last round's commit rate
        (infinite while nothing is committing)."""
        left = sum(s.queued + s.inflight for s in self.last_snapshots)
        rate = sum(s.samples_per_s for s in self.last_snapshots)
        return left / rate if rate > 0 else math.inf

    def reclaim_expired(self, name: str) -> int:
        """Take back every expired lease of ``name`` now (the script takes at most 256 a call)."""
        total = 0
        while n := self.ledger.reclaim(name):
            total += n
        return total

    def step(self) -> bool:
        """One round over the datasets. Returns True when every dataset is settled."""
        all_settled = True
        self.budget_waiting = False
        self.last_snapshots = []
        self.refill_s = math.inf
        stopped: list[DatasetFeed] = []
        if time.monotonic() - self.fed_at >= FED_EVERY_S:
            self.fed_at = time.monotonic()
            for feed in self.feeds:
                self.ledger.fed(feed.name)
        for feed in self.feeds:
            snap = self.ledger.snapshot(feed.name)
            self.last_snapshots.append(snap)
            if self.settled(feed, snap):
                continue
            all_settled = False
            if snap.state != DatasetState.ACTIVE:
                if snap.queued and self.queue_key is not None:
                    self.ledger.purge_queue(feed.name, self.queue_key, snap.state)
                if snap.state in (DatasetState.EXHAUSTED, DatasetState.REVOKED) and not feed.pass_complete:
                    stopped.append(feed)
                continue
            if feed.passes == 0:
                feed.start_pass()
            elif feed.pass_complete:
                if feed.skipped:
                    # stopped mid-pass and active again (a raised limit, a resume): the samples the
                    # pass only counted are fed by another
                    self.ledger.set_source(feed.name, done=False)
                    feed.start_pass(self.ledger.pending_ids(feed.name))
                elif snap.pending and not snap.queued and not snap.inflight:
                    # Expired leases count as pending but the ledger skips a leased sample: take them
                    # back first, or this pass would publish nothing.
                    self.reclaim_expired(feed.name)
                    self.ledger.set_source(feed.name, done=False)
                    feed.start_pass(self.ledger.pending_ids(feed.name))
                else:
                    continue
            published = self.published
            self._feed(feed, self.window - snap.queued)
            if not feed.exhausted_source:
                queued = snap.queued + self.published - published
                rate = snap.samples_per_s
                half = self.window / 2
                # a queue at least half full lasts this long at the rate its samples are taken
                refill_s = (queued - half) / rate if rate > 0 and queued > half else 0.0
                self.refill_s = min(self.refill_s, refill_s)
        self.counting = bool(stopped) and not self._count(stopped)
        return all_settled

    def _count(self, feeds: Sequence[DatasetFeed]) -> bool:
        """Read on through the sources of datasets a limit or a revoke stopped before their pass ended,
        feeding nothing, for at most `COUNT_SLICE_S` this round (after the others were fed), so that each
        ends with its source counted. Returns whether every one of them is counted."""
        deadline = time.monotonic() + COUNT_SLICE_S
        for feed in feeds:
            if feed.passes == 0:  # stopped before this run fed it
                feed.start_pass()
            if not feed.skip(deadline):
                return False
            self._complete_pass(feed)
        return True

    def _feed(self, feed: DatasetFeed, room: int) -> None:
        """Publish up to ``room`` samples of ``feed`` (the window less what the round's snapshot found
        queued): the ledger is asked about no more ids than may be published (its window check stays the
        rule; a stale snapshot costs one round)."""
        while room > 0:
            samples = feed.take(min(self.batch, room))
            if not samples:
                break
            codes = self.ledger.enqueue(feed.name, [s.sample_id for s in samples], self.window)
            if codes and codes[0] in (ENQUEUE_NOT_ACTIVE, ENQUEUE_BUDGET_IN_FLIGHT):
                feed.put_back(samples)
                # the budget is all reserved by generations in flight: each commit gives some back,
                # and the next round should find it soon
                self.budget_waiting = self.budget_waiting or codes[0] == ENQUEUE_BUDGET_IN_FLIGHT
                return
            to_publish = [s for s, c in zip(samples, codes, strict=False) if c == ENQUEUE_PUBLISH]
            if to_publish:
                try:
                    self.publish(feed.name, to_publish)
                except Exception as e:
                    # Some may have been published: unqueue makes pending only those still marked queued,
                    # and a sample published and fed again is dropped on its second delivery.
                    with contextlib.suppress(LedgerError):
                        self.ledger.unqueue(feed.name, [s.sample_id for s in to_publish], "publish_failed")
                    feed.put_back(samples[len(codes) :])
                    raise PublishError(f"publishing to the queue failed: {e}") from e
                feed.published_this_pass += len(to_publish)
                self.published += len(to_publish)
                room -= len(to_publish)
            if codes and codes[-1] == ENQUEUE_WINDOW_FULL:
                feed.put_back(samples[len(codes) - 1 :])
                return
        if feed.exhausted_source:
            self._complete_pass(feed)

    def _complete_pass(self, feed: DatasetFeed) -> None:
        """Tell the ledger what the pass, read to its end, found."""
        if feed.pass_complete:
            return
        # The pass is complete once the ledger says so: where Redis goes away before it does (a restart),
        # the next round says it again (the calls below are idempotent). Marked first, a dataset whose
        # source_done never reached the ledger would never settle.
        if feed.passes == 1:
            self.ledger.set_source(feed.name, total=feed.total, done=True, rejected=feed.rejected)
            feed.pass_complete = True
            return
        # Pending samples the pass did not find are not in the source any more; marks of samples done or
        # failed meanwhile are stale. Neither may keep the dataset from settling.
        orphans, stale = sorted(feed.unseen_pending), sorted(feed.seen_pending)
        if orphans or stale:
            cleared, _ = self.ledger.clear_pending(feed.name, orphans, stale)
            if cleared:
                log.warning(
                    "%s: %d pending sample(s) are no longer in the source; not fed again", feed.name, cleared
                )
        feed.unseen_pending, feed.seen_pending = set(), set()
        self.ledger.set_source(feed.name, done=True)
        feed.pass_complete = True

    def run(
        self,
        on_tick: Callable[[list[DatasetSnapshot]], None] | None = None,
        tick_s: float = 0.5,
        reclaim: bool = True,
        stall_s: float = 0.0,
        on_lost_ledger: Callable[[], None] | None = None,
    ) -> list[DatasetSnapshot]:
        """Feed until every dataset is settled; returns the final snapshots.

        Redis or the broker going away for a while (a restart) pauses feeding with a warning; the round is
        tried again until they answer (Ctrl-C stops, and a rerun resumes). With ``stall_s`` > 0, nothing
        changing in the ledger for that long while no worker is online raises `Unsettled`. A dataset
        missing from the ledger mid-run (Redis restarted without persistence, or flushed) calls
        ``on_lost_ledger`` (which should rebuild it) and starts every feed afresh; without the hook it
        raises ``UnknownDataset``."""
        last_tick = last_audit = last_look = 0.0
        mark: tuple[tuple[int, ...], ...] = ()
        moved = time.monotonic()
        idle_s = IDLE_POLL_S
        while True:
            published = self.published
            try:
                now = time.monotonic()
                if now - last_audit >= AUDIT_EVERY_S:
                    # The first round looks at every queued mark: one left by a producer killed between
                    # marking and publishing is found at once, not after the audit's usual delay.
                    self._housekeeping(
                        reclaim, audit_after_ms=0 if last_audit == 0.0 else DEFAULT_QUEUED_AUDIT_MS
                    )
                    last_audit = now
                done = self.step()
                # the round's own snapshots (read before it fed) serve the stall check and the display: a
                # reading of the ledger costs a dozen Redis commands per dataset
                fresh = len(self.last_snapshots) == len(self.feeds) and not done
                if stall_s > 0 and now - last_look >= min(1.0, stall_s) and not done:
                    last_look = now
                    snaps = self.last_snapshots if fresh else self.snapshots()
                    if progress_mark(snaps) != mark or self.counting:
                        mark, moved = progress_mark(snaps), now
                    elif now - moved >= stall_s and not self.ledger.workers():
                        raise Unsettled(f"no progress and no worker online for {now - moved:.0f} s", snaps)
                if on_tick is not None and (done or now - last_tick >= tick_s):
                    on_tick(self.last_snapshots if fresh else self.snapshots())
                    last_tick = now
                if done:
                    return self.snapshots()
            except (LedgerUnavailable, PublishError) as e:
                log.warning("feeding paused: %s; trying again in %.0f s", e, OUTAGE_RETRY_S)
                time.sleep(OUTAGE_RETRY_S)
                continue
            except UnknownDataset:
                if on_lost_ledger is None:
                    raise
                on_lost_ledger()
                for feed in self.feeds:
                    feed.reset()
                last_audit = 0.0
                continue
            longest = BUDGET_POLL_S if self.budget_waiting else IDLE_POLL_MAX_S
            if self.published != published:
                # each round reads every dataset's snapshot (a dozen Redis commands): while the queues
                # are at least half full the next may wait until one would be half empty
                idle_s = max(IDLE_POLL_S, min(longest, self.refill_s))
            else:
                idle_s = min(longest, idle_s * 2)
            if self.counting:  # a stopped dataset's source is counted a slice a round: the next comes soon
                idle_s = IDLE_POLL_S
            # The run ends at the first round after the last commit: near the end, look as often as the
            # end may come (a second's wait there was most of a short run's cost against a plain client).
            time.sleep(min(idle_s, max(IDLE_POLL_S, self.expected_end_s() / 2)))

    def _housekeeping(self, reclaim: bool, audit_after_ms: int) -> None:
        """Take back expired leases and queued samples whose message was lost (see the ledger scripts)."""
        for feed in self.feeds:
            if reclaim:
                self.ledger.reclaim(feed.name)
            if self.queue_key is not None:
                self.ledger.audit_queued(feed.name, self.queue_key, audit_after_ms)
