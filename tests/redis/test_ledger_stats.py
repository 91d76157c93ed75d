"""The figures people ask about, counted by the ledger's scripts in a real Redis: reasoning tokens apart
from answer tokens, samples that ended at max_new_tokens, and tokens per sample as a log-scale histogram
(mean, p50, p95) — only of committed generations, each once."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import redis

from budget import CommitItem, CommitOutcome, DatasetState, Ledger
from budget.keys import dataset_keys
from budget.lengths import bucket_of, percentile
from tests.support.ledger import DS, commit_new, lease, make

pytestmark = pytest.mark.redis


def committed(ledger: Ledger, items: list[CommitItem]) -> list[CommitOutcome]:
    """Admit each item's sample for its attempt, then commit them all in one batch."""
    for it in items:
        lease(ledger, it.sample_id, it.attempt, want=max(1, it.completion_tokens))
    return ledger.commit_many(DS, items)


def test_reasoning_tokens_and_max_new_hits_count_once_per_committed_sample(ledger: Ledger) -> None:
    make(ledger, token_budget=100_000)
    outcomes = committed(
        ledger,
        [
            CommitItem("s1", "a", 40, reasoning_tokens=30),
            CommitItem("s2", "a", 64, reasoning_tokens=64, hit_max_new=True),
            CommitItem("s3", "a", 12, truncated=True),
        ],
    )
    # a second attempt of s1, a duplicate in the same batch, and a forgotten sample's late commit
    late = ledger.commit_many(
        DS,
        [
            CommitItem("s1", "late", 50, reasoning_tokens=50, hit_max_new=True),
            CommitItem("s4", "a", 7, reasoning_tokens=3),
            CommitItem("s4", "a", 7, reasoning_tokens=3),
        ],
    )

    assert outcomes == [CommitOutcome.COMMITTED] * 3
    assert late == [CommitOutcome.DUPLICATE, CommitOutcome.COMMITTED, CommitOutcome.DUPLICATE]
    snap = ledger.snapshot(DS)
    assert (snap.tokens, snap.samples, snap.truncated) == (40 + 64 + 12 + 7, 4, 1)
    assert snap.reasoning_tokens == 30 + 64 + 3
    assert snap.answer_tokens == snap.tokens - snap.reasoning_tokens == 26
    assert snap.hit_max_new == 1
    assert snap.hit_max_new_share == 0.25
    assert snap.longest == 64


def test_generations_not_counted_add_nothing_to_reasoning_hits_or_lengths(ledger: Ledger) -> None:
    make(ledger, max_samples=3)
    commit_new(ledger, "s0", 9)
    lease(ledger, "s1")
    lease(ledger, "s2")
    ledger.set_limits(DS, max_samples=2)  # lowered while both run: the second one is over the cap

    outcomes = ledger.commit_many(
        DS,
        [
            CommitItem("s1", "a1", 500, reasoning_tokens=400, hit_max_new=True),
            CommitItem("s2", "a1", 3000, reasoning_tokens=2000, hit_max_new=True),
        ],
    )

    assert outcomes == [CommitOutcome.COMMITTED, CommitOutcome.OVER_LIMIT]
    snap = ledger.snapshot(DS)
    assert snap.state == DatasetState.EXHAUSTED
    assert (snap.samples, snap.reasoning_tokens, snap.hit_max_new, snap.longest) == (2, 400, 1, 500)
    assert snap.lengths == {bucket_of(9): 1, bucket_of(500): 1}


def test_a_revoked_datasets_late_commits_count_no_reasoning(ledger: Ledger) -> None:
    make(ledger)
    lease(ledger, "s1")
    ledger.revoke(DS)

    assert ledger.commit_many(DS, [CommitItem("s1", "a1", 20, reasoning_tokens=20)]) == [
        CommitOutcome.REVOKED
    ]
    snap = ledger.snapshot(DS)
    assert (snap.reasoning_tokens, snap.hit_max_new, snap.lengths) == (0, 0, {})


def test_reasoning_tokens_are_never_counted_above_the_completion_or_below_zero(ledger: Ledger) -> None:
    make(ledger)

    committed(
        ledger,
        [CommitItem("s1", "a", 10, reasoning_tokens=25), CommitItem("s2", "a", 10, reasoning_tokens=-4)],
    )

    snap = ledger.snapshot(DS)
    assert (snap.tokens, snap.reasoning_tokens, snap.answer_tokens) == (20, 10, 10)


def test_the_lengths_histogram_over_many_batches_gives_the_mean_and_percentiles_of_every_sample(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)
    rng = random.Random(7)
    lengths = [max(0, round(rng.lognormvariate(5.5, 1.0))) for _ in range(600)]
    start = 0
    while start < len(lengths):  # batches of 1 to 64, as a worker's CallBatcher makes them
        size = rng.randint(1, 64)
        batch = [CommitItem(f"s{i}", "a", lengths[i]) for i in range(start, min(start + size, len(lengths)))]
        assert committed(ledger, batch) == [CommitOutcome.COMMITTED] * len(batch)
        start += size

    snap = ledger.snapshot(DS)
    expected = Counter(bucket_of(n) for n in lengths)
    assert snap.lengths == dict(expected)
    stored = redis_client.hgetall(dataset_keys(DS).lengths_hash)
    assert {int(b): int(c) for b, c in stored.items()} == dict(expected)
    assert snap.tokens_per_sample == sum(lengths) / len(lengths)
    assert snap.longest == max(lengths)
    ordered = sorted(lengths)
    true_p50, true_p95 = ordered[299], ordered[569]  # nearest rank: the 300th and the 570th of 600
    assert snap.tokens_per_sample_p50 == percentile(expected, 50, max(lengths))
    assert snap.tokens_per_sample_p95 == percentile(expected, 95, max(lengths))
    assert true_p50 <= snap.tokens_per_sample_p50 < true_p50 * 2 ** (1 / 4)
    assert true_p95 <= snap.tokens_per_sample_p95 < true_p95 * 2 ** (1 / 4)


def test_a_dataset_without_samples_has_no_per_sample_figures(ledger: Ledger) -> None:
    make(ledger)

    snap = ledger.snapshot(DS)

    assert snap.lengths == {}
    assert snap.tokens_per_sample is None
    assert snap.tokens_per_sample_p50 is None
    assert snap.tokens_per_sample_p95 is None
    assert snap.hit_max_new_share is None


def test_rebuild_restores_reasoning_hits_and_the_lengths_histogram_from_the_records(ledger: Ledger) -> None:
    make(ledger)
    committed(ledger, [CommitItem("gone", "a", 3000, reasoning_tokens=100, hit_max_new=True)])
    lengths = [5, 5, 80, 1200]

    ledger.rebuild(
        DS,
        done={f"s{i}": "a" for i in range(len(lengths))},
        tokens=sum(lengths),
        truncated=0,
        failed={},
        reasoning_tokens=700,
        hit_max_new=1,
        lengths=lengths,
    )

    snap = ledger.snapshot(DS)
    assert (snap.samples, snap.tokens, snap.reasoning_tokens, snap.hit_max_new) == (4, 1290, 700, 1)
    assert snap.lengths == {bucket_of(5): 2, bucket_of(80): 1, bucket_of(1200): 1}
    assert snap.longest == 1200


def test_forget_removes_the_lengths_histogram(ledger: Ledger, redis_client: redis.Redis) -> None:
    make(ledger)
    commit_new(ledger, "s1", 10)
    assert redis_client.exists(dataset_keys(DS).lengths_hash)

    ledger.forget(DS)

    assert not redis_client.exists(dataset_keys(DS).lengths_hash)
