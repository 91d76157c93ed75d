"""Property-style test of the ledger under concurrent workers on real Redis.

Eight threads each handle fifty deliveries; every sample is delivered twice (Celery may redeliver), in a
random order. A worker admitted for a sample reports its live tokens a few times (never more than its
reservation, as the server stops it there), then mostly commits, sometimes releases or fails it; a worker
told ``leased`` sometimes commits anyway (an attempt that lost its lease but finished). Whatever the
interleaving, the ledger must count each sample once, with the tokens of the attempt whose commit won.

Then workers admitting groups, asking more for some (extend), and committing batches under a token budget:
committed + discarded + reserved never passes what the budget may grant (the budget under truncate, the
budget plus 1% under discard), read at any moment by a watcher thread.
"""

from __future__ import annotations

import math
import random
import threading
from dataclasses import dataclass, field

import pytest
import redis

from budget import (
    Admission,
    CommitItem,
    CommitOutcome,
    DatasetLimits,
    DatasetState,
    GrantAsk,
    GrantKind,
    Ledger,
)
from budget.ledger import GRANT_AT_SEND, GRANT_WAIT
from tests.redis.grants import clock_agrees, grant_pool, overdrawn
from tests.support.ledger import budget_taken

pytestmark = pytest.mark.redis

DS = "ds"
THREADS = 8
PER_THREAD = 50
SAMPLES = THREADS * PER_THREAD // 2  # each delivered twice
MAX_NEW = 60
SPEC = {"servers": ["s"], "sampling": {"max_new_tokens": MAX_NEW}}


@dataclass
class Journal:
    """What one worker thread did, to check the ledger against."""

    committed: list[tuple[str, str, int]] = field(default_factory=list)
    #: (sid, outcome, tokens, whether the attempt had lost its lease: a zombie, holding no reservation)
    rejected_commits: list[tuple[str, CommitOutcome, int, bool]] = field(default_factory=list)
    released: list[tuple[str, int]] = field(default_factory=list)
    failed: list[tuple[str, int]] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)


def _worker(
    redis_url: str, worker: int, deliveries: list[str], barrier: threading.Barrier, journal: Journal
) -> None:
    rng = random.Random(1000 + worker)
    ledger = Ledger(redis.Redis.from_url(redis_url, decode_responses=True))
    try:
        barrier.wait()
        for k, sid in enumerate(deliveries):
            attempt = f"w{worker}-{k}"
            admitted = ledger.admit(DS, sid, attempt)
            verdict, cap = admitted.admission, admitted.cap or MAX_NEW
            zombie = verdict is Admission.LEASED
            if zombie and rng.random() < 0.5:
                verdict = Admission.OK  # a zombie attempt: it finished after losing its lease
            elif verdict is not Admission.OK:
                continue
            tokens = 0
            for _ in range(rng.randint(1, 3)):
                tokens = min(cap, tokens + rng.randint(1, 20))
                if not ledger.renew_many(DS, [(sid, attempt, tokens)])[0]:
                    zombie = True  # its lease is gone
                    break
            roll = rng.random()
            if roll < 0.8:
                outcome = ledger.commit(DS, sid, attempt, tokens, truncated=roll < 0.1)
                if outcome is CommitOutcome.COMMITTED:
                    journal.committed.append((sid, attempt, tokens))
                else:
                    journal.rejected_commits.append((sid, outcome, tokens, zombie))
            elif roll < 0.93:
                ledger.release(DS, sid, attempt, "worker shutdown", thrown_away_tokens=tokens)
                journal.released.append((sid, tokens))
            else:
                ledger.fail(DS, sid, attempt, "server error", wasted_tokens=tokens)
                journal.failed.append((sid, tokens))
    except BaseException as e:  # reported by the main thread
        journal.errors.append(e)
    finally:
        ledger.client.close()


@pytest.mark.parametrize(
    ("token_budget", "max_samples"),
    [(None, None), (None, 60), (1500, None)],
    ids=["no-limits", "max-samples", "token-budget"],
)
def test_concurrent_workers_count_every_sample_exactly_once(
    ledger: Ledger, redis_url: str, token_budget: int | None, max_samples: int | None
) -> None:
    ledger.register(DS, DatasetLimits(token_budget, max_samples, "truncate"), SPEC)
    deliveries = [f"s{i:03d}" for i in range(SAMPLES)] * 2
    random.Random(7).shuffle(deliveries)
    journals = [Journal() for _ in range(THREADS)]
    barrier = threading.Barrier(THREADS)
    threads = [
        threading.Thread(
            target=_worker,
            args=(redis_url, w, deliveries[w * PER_THREAD : (w + 1) * PER_THREAD], barrier, journals[w]),
        )
        for w in range(THREADS)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert [e for j in journals for e in j.errors] == []

    committed = [c for j in journals for c in j.committed]
    rejected = [r for j in journals for r in j.rejected_commits]
    released = [r for j in journals for r in j.released]
    failed = [f for j in journals for f in j.failed]
    snap = ledger.snapshot(DS)
    done = ledger.done_attempts(DS)

    # exactly once: one winning commit per sample, and the ledger holds exactly those
    assert len({sid for sid, _, _ in committed}) == len(committed)
    assert done == {sid: attempt for sid, attempt, _ in committed}
    assert snap.samples == len(done) == len(committed)
    assert snap.tokens == sum(tokens for _, _, tokens in committed)
    assert {outcome for _, outcome, _, _ in rejected} <= {CommitOutcome.DUPLICATE, CommitOutcome.OVER_LIMIT}
    # a commit refused for a sample not done: the sample cap was reached, or (budget/lua/commit.lua) a
    # zombie attempt, which holds no reservation, found no room left in the token budget
    for sid, outcome, _, zombie in rejected:
        no_room = token_budget is not None and zombie and outcome is CommitOutcome.OVER_LIMIT
        assert sid in done or max_samples is not None or no_room, (sid, outcome, zombie)

    # nothing is left in flight and every token generated and not committed is reported as wasted
    assert (snap.live_tokens, snap.inflight, snap.queued, snap.reclaimed) == (0, 0, 0, 0)
    assert snap.reserved_tokens == 0
    assert snap.wasted_tokens == (
        sum(n for _, _, n, _ in rejected) + sum(n for _, n in released) + sum(n for _, n in failed)
    )
    assert ledger.pending_ids(DS).isdisjoint(done)

    if max_samples is not None:
        assert snap.samples <= max_samples
        assert (snap.state == DatasetState.EXHAUSTED) is (snap.samples == max_samples)
    if token_budget is not None:
        assert (snap.state == DatasetState.EXHAUSTED) is (snap.tokens >= token_budget)
    if token_budget is None and max_samples is None:
        assert snap.state == DatasetState.ACTIVE
        assert len(committed) > SAMPLES // 2  # the test did exercise the commit path


# --- the budget invariant under group admits and batched commits --------------------------------------

GROUP = 4
BUDGET = 2000


@dataclass
class GroupJournal:
    committed: int = 0
    limited: int = 0
    #: asks for more, and those answered with more than the grant held
    asked_more: int = 0
    extended: int = 0
    #: committed + discarded + reserved, read right after each of this worker's admits and commits
    seen: list[int] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)


def _group_worker(
    redis_url: str,
    worker: int,
    groups: list[list[str]],
    on_budget: str,
    barrier: threading.Barrier,
    journal: GroupJournal,
) -> None:
    """Admit each group in one call, (truncate) ask their grants at once as if each had a server slot, ask
    more for about half of the batch in one call (up to the dataset's max_new_tokens), generate at most
    each grant (discard: at most max_new_tokens), and end the batch in one commit_many (now and then a
    release, counted against the budget under discard, or a fail)."""
    rng = random.Random(2000 + worker)
    ledger = Ledger(redis.Redis.from_url(redis_url, decode_responses=True))
    try:
        barrier.wait()
        for k, group in enumerate(groups):
            attempt = f"w{worker}-{k}"
            admitted = ledger.admit_many(DS, [(sid, attempt, 0) for sid in group])
            journal.seen.append(budget_taken(ledger.client, DS))
            items: list[CommitItem] = []
            grants: dict[str, int] = {}
            for sid, (verdict, cap) in zip(group, admitted.results, strict=True):
                if verdict is Admission.LIMIT:
                    journal.limited += 1
                if verdict is Admission.OK:
                    # truncate grants at send time; discard reserves nothing: its answer may be whole
                    assert cap == (GRANT_AT_SEND if on_budget == "truncate" else 0)
                    grants[sid] = cap if on_budget == "truncate" else MAX_NEW
            starting = [sid for sid, cap in grants.items() if cap == GRANT_AT_SEND]
            if starting:  # truncate: granted when they have a slot (8 slots here)
                got = ledger.grant_many(
                    DS, [GrantAsk(sid, attempt, GrantKind.START, MAX_NEW) for sid in starting], slots=8
                )
                journal.seen.append(budget_taken(ledger.client, DS))
                for sid, grant in zip(starting, got, strict=True):
                    assert grant != 0  # the lease is held
                    if grant < 0:  # none now: the sample goes back
                        journal.limited += 1
                        ledger.release(DS, sid, attempt, "limit")
                        del grants[sid]
                    else:
                        assert 1 <= grant <= MAX_NEW
                        grants[sid] = grant
            asks = [
                GrantAsk(sid, attempt, GrantKind.MORE, MAX_NEW - cap)
                for sid, cap in grants.items()
                if on_budget == "truncate" and rng.random() < 0.5
            ]
            if asks:
                journal.asked_more += len(asks)
                after = ledger.grant_many(DS, asks, slots=8)
                journal.seen.append(budget_taken(ledger.client, DS))
                for ask, grant in zip(asks, after, strict=True):
                    sid = ask.sample_id
                    if grant == GRANT_WAIT:  # none now, a few others run: it ends at its grant here
                        grant = grants[sid]
                    assert grants[sid] <= grant <= grants[sid] + ask.value  # the lease is held: never 0
                    journal.extended += grant > grants[sid]
                    grants[sid] = grant
            for sid, cap in grants.items():
                tokens = rng.randint((cap + 1) // 2, cap)  # the worker aborts its stream at its grant
                ledger.renew_many(DS, [(sid, attempt, tokens // 2)])
                roll = rng.random()
                if roll < 0.85:
                    items.append(
                        CommitItem(sid, attempt, tokens, truncated=on_budget == "truncate" and tokens == cap)
                    )
                elif roll < 0.95:
                    ledger.release(
                        DS, sid, attempt, "discarded", tokens, counts_against_budget=on_budget == "discard"
                    )
                else:
                    ledger.fail(DS, sid, attempt, "server error", wasted_tokens=tokens)
            outcomes = ledger.commit_many(DS, items)
            journal.seen.append(budget_taken(ledger.client, DS))
            journal.committed += sum(o is CommitOutcome.COMMITTED for o in outcomes)
    except BaseException as e:  # reported by the main thread
        journal.errors.append(e)
    finally:
        ledger.client.close()


@pytest.mark.parametrize("on_budget", ["truncate", "discard"])
def test_committed_discarded_and_reserved_tokens_never_pass_the_budget_under_concurrent_groups(
    ledger: Ledger, redis_client: redis.Redis, redis_url: str, on_budget: str
) -> None:
    ledger.register(DS, DatasetLimits(BUDGET, None, on_budget), SPEC)
    sids = [f"s{i:03d}" for i in range(THREADS * 15 * GROUP)]
    groups = [sids[i : i + GROUP] for i in range(0, len(sids), GROUP)]
    journals = [GroupJournal() for _ in range(THREADS)]
    barrier = threading.Barrier(THREADS)
    threads = [
        threading.Thread(
            target=_group_worker,
            args=(redis_url, w, groups[w::THREADS], on_budget, barrier, journals[w]),
        )
        for w in range(THREADS)
    ]
    seen: list[int] = []
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):  # the watcher: one consistent read at a time
        seen.append(budget_taken(redis_client, DS))
    for t in threads:
        t.join(timeout=30)
    assert [e for j in journals for e in j.errors] == []

    seen += [n for j in journals for n in j.seen]
    pool = grant_pool(on_budget, BUDGET)  # 2000 under truncate, 2020 under discard
    snap = ledger.snapshot(DS)
    spent = snap.tokens + snap.discarded_tokens
    if on_budget == "truncate":
        assert max(seen) <= pool
        assert spent <= pool
    else:
        # discard reserves nothing: what it keeps never passes the pool (an answer that would is thrown
        # away whole at commit); what it threw away at a stop is counted apart, as discarded
        assert snap.tokens <= pool
    assert overdrawn(redis_client, DS) == 0  # no stream passed its grant here
    assert (snap.reserved_tokens, snap.live_tokens, snap.inflight) == (0, 0, 0)
    assert redis_client.hlen(ledger.keys_of(DS).reserved_hash) == 0
    assert clock_agrees(redis_client, DS)
    # the budget was contended: admits were turned away for it, and most of it was spent
    assert sum(j.limited for j in journals) > 0
    if on_budget == "truncate":  # discard reserves nothing: nothing more to ask
        # asks for more raced the others (whether any found the budget not yet all granted depends on
        # the interleaving: 1 run in 10 under load found none)
        assert sum(j.asked_more for j in journals) > 0
    assert spent > BUDGET // 2
    assert snap.samples == sum(j.committed for j in journals)
    if on_budget == "truncate":
        assert (snap.state == DatasetState.EXHAUSTED) is (spent >= BUDGET)
    else:  # less left than one answer is admitted with (discard_one in _lib.lua): the expected answer
        # (E[L^2] / E[L] of the committed lengths) within the budget, and that plus two spreads of the
        # committed lengths within the budget and its 1% slack
        tokens_sq = int(redis_client.hget(ledger.keys_of(DS).ledger_hash, "tokens_sq") or 0)
        mean = snap.tokens / snap.samples
        spread = math.sqrt(max(0.0, tokens_sq / snap.samples - mean * mean))
        expected = tokens_sq / snap.tokens
        need = math.ceil(max(expected, expected + 2 * spread - BUDGET // 100))
        assert (snap.state == DatasetState.EXHAUSTED) is (BUDGET - spent < need)
