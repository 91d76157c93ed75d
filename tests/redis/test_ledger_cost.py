"""What a group costs the ledger's Redis: one group admit, one renew of its leases and one batch commit
each run a fixed number of Redis commands, whatever the group's size (the claim in the headers of
``budget/lua/admit.lua``, ``renew.lua`` and ``commit.lua``).

Counted with the server's ``total_commands_processed`` (INFO stats), which counts the commands a script
runs as well as the script call, on a Redis server of the test's own (another client, such as a worker
left running by an earlier test, would add to the counts).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from budget import Admission, CommitItem, CommitOutcome, Ledger
from tests.support.ledger import DS, make
from tokenfleet.processes import embedded_redis

pytestmark = pytest.mark.redis

TRIES = 3
#: Commands for one admit_many plus one commit_many of a group of 16, at most (about 50 today: one more
#: command per sample would pass it).
GROUP_BOUND = 60
#: How many more commands a larger group may cost (the rate rings' trim check runs in one second of 16).
SPREAD = 2


@pytest.fixture
def own_ledger(tmp_path: Path) -> Iterator[tuple[Ledger, redis.Redis]]:
    with embedded_redis(tmp_path / "redis") as url:
        ledger = Ledger.from_url(url)
        yield ledger, ledger.client


def commands_processed(client: redis.Redis) -> int:
    return int(client.info("stats")["total_commands_processed"])


def group_cost(ledger: Ledger, client: redis.Redis, size: int, tag: str) -> tuple[int, int, int]:
    """The commands Redis ran for one admit_many of ``size`` new samples, one renew_many of their leases
    with live tokens, and one commit_many of them of many lengths (each figure includes one INFO, the
    same for every size)."""
    samples = [(f"{tag}-{i}", "a", 0) for i in range(size)]
    before = commands_processed(client)
    group = ledger.admit_many(DS, samples)
    admitted = commands_processed(client)
    held = ledger.renew_many(DS, [(sid, "a", 3) for sid, _, _ in samples])
    renewed = commands_processed(client)
    # lengths over many buckets of the lengths histogram, some reasoning, some max_new_tokens hits: the
    # histogram's cost must not grow with the distinct buckets a batch touches
    items = [
        CommitItem(sid, "a", 1 + (i * 37) % 3000, reasoning_tokens=i % 7, hit_max_new=i % 3 == 0)
        for i, (sid, _, _) in enumerate(samples)
    ]
    outcomes = ledger.commit_many(DS, items)
    committed = commands_processed(client)
    assert [admission for admission, _ in group.results] == [Admission.OK] * size
    assert held == [True] * size
    assert outcomes == [CommitOutcome.COMMITTED] * size
    return admitted - before, renewed - admitted, committed - renewed


def least_cost(ledger: Ledger, client: redis.Redis, size: int) -> tuple[int, int, int]:
    costs = [group_cost(ledger, client, size, f"n{size}-t{t}") for t in range(TRIES)]
    return min(c[0] for c in costs), min(c[1] for c in costs), min(c[2] for c in costs)


def spread(*counts: int) -> int:
    return max(counts) - min(counts)


@pytest.mark.parametrize("on_budget", ["truncate", "discard", "drain"])
def test_a_group_admit_renew_and_batch_commit_cost_the_same_commands_for_4_16_and_64_samples(
    own_ledger: tuple[Ledger, redis.Redis], on_budget: str
) -> None:
    ledger, redis_client = own_ledger
    # every limit set, so every check the scripts make is made: a token budget and a sample cap
    make(ledger, token_budget=10**9, max_samples=10**6, on_budget=on_budget)
    group_cost(ledger, redis_client, 1, "warm-up")  # the scripts are loaded into Redis once

    admit4, renew4, commit4 = least_cost(ledger, redis_client, 4)
    admit16, renew16, commit16 = least_cost(ledger, redis_client, 16)
    admit64, renew64, commit64 = least_cost(ledger, redis_client, 64)

    assert admit16 + commit16 < GROUP_BOUND, (admit16, commit16)
    assert spread(admit4, admit16, admit64) <= SPREAD, (admit4, admit16, admit64)
    assert spread(renew4, renew16, renew64) <= SPREAD, (renew4, renew16, renew64)
    assert spread(commit4, commit16, commit64) <= SPREAD, (commit4, commit16, commit64)
    snap = ledger.snapshot(DS)
    assert snap.samples == 1 + TRIES * (4 + 16 + 64)
    assert snap.reserved_tokens == 0
    assert sum(snap.lengths.values()) == snap.samples
    assert len(snap.lengths) >= 16  # the batches of 16 and 64 spanned many buckets
