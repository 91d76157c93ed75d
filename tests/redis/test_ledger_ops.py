"""The ledger's operational scripts against real Redis: give_up, audit_queued, purge_queue, heartbeat and
workers, the rate rings behind snapshot's tokens_per_s / samples_per_s, rebuild, and commit after revoke.

The broker's queue holds real Celery messages, published by the project's ``TaskPublisher`` into the test
database (no worker consumes there). Lease expiry uses a lease of 50 ms and a sleep of 100 ms, and ages
are made by writing Redis-clock timestamps directly (the scripts read Redis's own clock).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from importlib import resources

import pytest
import redis

from budget import Admission, CommitOutcome, DatasetState, Ledger
from budget.keys import WORKERS_HASH
from budget.ledger import RATE_WINDOW_S, WORKER_SEEN_WITHIN_S
from producer.source import Sample
from tests.support.ledger import (
    DS,
    SHORT_MS,
    commit_new,
    expire_short_leases,
    keys,
    lease,
    make,
    pending,
    queued,
    report_live,
)
from tokenfleet.publish import TaskPublisher
from workers.messages import QUEUE_NAME

pytestmark = pytest.mark.redis

OTHER = "ds2"  # a name DS is a prefix of: matching must be exact
OLD_MS = 300_000  # how far back "old" queued entries are dated

Publish = Callable[[str, list[str]], None]


@pytest.fixture
def publish(redis_url: str, redis_client: redis.Redis) -> Iterator[Publish]:
    """Publish real generate tasks for ``dataset``'s sample ids into the test database's queue."""
    from workers.app import make_app

    app = make_app(redis_url)
    publisher = TaskPublisher(app)

    def send(dataset: str, sample_ids: list[str]) -> None:
        publisher(dataset, [Sample(sid, i + 1, [1, 2], None, {}) for i, sid in enumerate(sample_ids)])

    yield send
    app.close()


def server_ms(redis_client: redis.Redis) -> int:
    s, us = redis_client.time()
    return int(s) * 1000 + int(us) // 1000


def server_s(redis_client: redis.Redis) -> int:
    return int(redis_client.time()[0])


def backdate(redis_client: redis.Redis, sids: list[str], name: str = DS, ago_ms: int = OLD_MS) -> None:
    """Make queued entries look as if they were queued ``ago_ms`` ago."""
    when = server_ms(redis_client) - ago_ms
    assert redis_client.zadd(keys(name).queued_zset, dict.fromkeys(sids, when), xx=True, ch=True) == len(sids)


def describe(raw: str) -> tuple[str, str] | str:
    """A queue item as (dataset, sample id) when it is one of our messages, else the raw text."""
    try:
        headers = json.loads(raw)["headers"]
        return headers["stamps"]["dataset"], headers["tf_sample_id"]
    except (ValueError, TypeError, KeyError):
        return raw


def queue(redis_client: redis.Redis) -> list[tuple[str, str] | str]:
    return [describe(raw) for raw in redis_client.lrange(QUEUE_NAME, 0, -1)]


def ring(redis_client: redis.Redis, key: str) -> dict[int, int]:
    return {int(sec): int(n) for sec, n in redis_client.hgetall(key).items()}


# --- give_up ----------------------------------------------------------------------------------------


def test_give_up_makes_the_sample_pending_with_reason_server_unavailable_and_drops_lease_and_live_tokens(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)
    lease(ledger, "s1")
    lease(ledger, "s2")
    report_live(ledger, "s1", "a1", 12)
    report_live(ledger, "s2", "a1", 5)

    assert ledger.give_up(DS, "s1", "a1", "HTTP 503 after 5 retries", wasted_tokens=12) == "pending"

    assert pending(redis_client) == {"s1": "server_unavailable"}
    assert redis_client.hget(keys().lease_owner_hash, "s1") is None
    assert redis_client.hget(keys().live_hash, "s1") is None
    assert redis_client.zscore(keys().lease_zset, "s1") is None
    assert redis_client.hgetall(keys().strikes_hash) == {"s1": "1"}
    snap = ledger.snapshot(DS)
    assert (snap.live_tokens, snap.wasted_tokens, snap.inflight, snap.pending) == (5, 12, 1, 1)
    assert (snap.failed, snap.samples, snap.tokens) == (0, 0, 0)
    assert redis_client.hget(keys().lease_owner_hash, "s2") == "a1"
    assert ledger.enqueue(DS, ["s1"], window=10) == [1]  # fed again


@pytest.mark.parametrize("max_strikes", [1, 2, 3])
def test_give_up_fails_the_sample_for_good_on_the_max_strikes_th_give_up(
    ledger: Ledger, redis_client: redis.Redis, max_strikes: int
) -> None:
    make(ledger)
    for strike in range(1, max_strikes):
        lease(ledger, "s1", f"a{strike}")
        assert ledger.give_up(DS, "s1", f"a{strike}", "timeout", max_strikes=max_strikes) == "pending"
        assert redis_client.hget(keys().strikes_hash, "s1") == str(strike)
        assert ledger.failures(DS) == {}
    lease(ledger, "s1", "last")
    report_live(ledger, "s1", "last", 7)

    assert ledger.give_up(DS, "s1", "last", "HTTP 502", wasted_tokens=7, max_strikes=max_strikes) == "failed"

    assert ledger.failures(DS) == {"s1": "HTTP 502"}
    assert pending(redis_client) == {}
    assert redis_client.hget(keys().strikes_hash, "s1") is None
    assert redis_client.hget(keys().lease_owner_hash, "s1") is None
    snap = ledger.snapshot(DS)
    assert (snap.failed, snap.pending, snap.inflight, snap.live_tokens, snap.wasted_tokens) == (1, 0, 0, 0, 7)
    assert ledger.admit(DS, "s1", "again").admission is Admission.FAILED
    assert ledger.enqueue(DS, ["s1"], window=10) == [0]


def test_give_up_counts_strikes_per_sample(ledger: Ledger, redis_client: redis.Redis) -> None:
    make(ledger)
    for sid in ("s1", "s2", "s1"):
        lease(ledger, sid, f"{sid}-{time.monotonic_ns()}")
        owner = redis_client.hget(keys().lease_owner_hash, sid)
        assert ledger.give_up(DS, sid, str(owner), "timeout", max_strikes=3) == "pending"

    assert redis_client.hgetall(keys().strikes_hash) == {"s1": "2", "s2": "1"}
    assert ledger.failures(DS) == {}


def test_give_up_of_a_committed_sample_answers_duplicate_and_records_only_the_wasted_tokens(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)
    commit_new(ledger, "s1", 4)

    assert ledger.give_up(DS, "s1", "late", "timeout", wasted_tokens=3) == "duplicate"

    assert pending(redis_client) == {}
    assert ledger.failures(DS) == {}
    assert redis_client.hgetall(keys().strikes_hash) == {}
    snap = ledger.snapshot(DS)
    assert (snap.samples, snap.tokens, snap.failed, snap.pending, snap.wasted_tokens) == (1, 4, 0, 0, 3)


def test_a_duplicate_give_up_by_the_lease_holder_still_drops_its_lease(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)
    lease(ledger, "s1", "a1", lease_ms=SHORT_MS)
    expire_short_leases(ledger.client)
    lease(ledger, "s1", "a2")  # redelivered after a1's lease expired; a1 is still running
    report_live(ledger, "s1", "a2", 6)
    assert ledger.commit(DS, "s1", "a1", 9) is CommitOutcome.COMMITTED

    assert ledger.give_up(DS, "s1", "a2", "timeout", wasted_tokens=6) == "duplicate"

    assert redis_client.hget(keys().lease_owner_hash, "s1") is None
    snap = ledger.snapshot(DS)
    assert (snap.live_tokens, snap.inflight, snap.pending, snap.samples) == (0, 0, 0, 1)


def test_give_up_by_an_attempt_that_lost_the_lease_keeps_the_new_holders_lease(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)
    lease(ledger, "s1", "old", lease_ms=SHORT_MS)
    expire_short_leases(ledger.client)
    lease(ledger, "s1", "new")
    report_live(ledger, "s1", "new", 6)

    assert ledger.give_up(DS, "s1", "old", "timeout") == "pending"

    assert redis_client.hget(keys().lease_owner_hash, "s1") == "new"
    assert ledger.snapshot(DS).live_tokens == 6


def test_give_up_after_forget_answers_unknown_and_writes_nothing(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)
    lease(ledger, "s1")
    ledger.forget(DS)

    assert ledger.give_up(DS, "s1", "a1", "timeout", wasted_tokens=5) == "unknown"

    assert redis_client.keys("*") == []


def test_give_up_of_a_sample_that_already_failed_for_good_leaves_it_failed_and_not_pending(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)
    lease(ledger, "s1", "a1")
    assert ledger.give_up(DS, "s1", "a1", "HTTP 503", max_strikes=2) == "pending"
    lease(ledger, "s1", "a2", lease_ms=SHORT_MS)
    expire_short_leases(ledger.client)
    lease(ledger, "s1", "a3")  # redelivered after a2's lease expired; a2 is still running
    assert ledger.give_up(DS, "s1", "a3", "HTTP 503", max_strikes=2) == "failed"

    result = ledger.give_up(DS, "s1", "a2", "HTTP 503", max_strikes=2)  # a2's retries run out too

    assert ledger.failures(DS) == {"s1": "HTTP 503"}
    assert pending(redis_client) == {}
    assert redis_client.hget(keys().strikes_hash, "s1") is None
    assert result == "failed"


# --- audit_queued -----------------------------------------------------------------------------------


def test_audit_queued_leaves_alone_entries_younger_than_older_than_ms(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)
    assert ledger.enqueue(DS, ["s1", "s2"], window=10) == [1, 1]  # marked queued, never published
    backdate(redis_client, ["s1"], ago_ms=30_000)

    assert ledger.audit_queued(DS, QUEUE_NAME, older_than_ms=60_000) == 0

    assert queued(redis_client) == {"s1", "s2"}
    assert pending(redis_client) == {}


def test_audit_queued_leaves_alone_old_entries_whose_message_is_still_in_the_queue(
    ledger: Ledger, redis_client: redis.Redis, publish: Publish
) -> None:
    make(ledger)
    assert ledger.enqueue(DS, ["s1", "s2"], window=10) == [1, 1]
    publish(DS, ["s1", "s2"])
    backdate(redis_client, ["s1", "s2"])

    assert ledger.audit_queued(DS, QUEUE_NAME, older_than_ms=60_000) == 0

    assert queued(redis_client) == {"s1", "s2"}
    assert pending(redis_client) == {}
    assert redis_client.llen(QUEUE_NAME) == 2


def test_audit_queued_makes_old_entries_whose_message_is_gone_pending_with_reason_lost_message(
    ledger: Ledger, redis_client: redis.Redis, publish: Publish
) -> None:
    make(ledger)
    make(ledger, OTHER)
    assert ledger.enqueue(DS, ["s1", "s2", "s3", "young"], window=10) == [1, 1, 1, 1]
    assert ledger.enqueue(OTHER, ["s2"], window=10) == [1]
    publish(DS, ["s1"])
    publish(OTHER, ["s2"])  # the same sample id in another dataset does not keep DS's s2
    redis_client.lpush(QUEUE_NAME, "not json {")  # nor does a malformed item trouble the audit
    backdate(redis_client, ["s1", "s2", "s3"])
    backdate(redis_client, ["s2"], name=OTHER)

    assert ledger.audit_queued(DS, QUEUE_NAME, older_than_ms=60_000) == 2

    assert pending(redis_client) == {"s2": "lost_message", "s3": "lost_message"}
    assert queued(redis_client) == {"s1", "young"}
    snap = ledger.snapshot(DS)
    assert (snap.queued, snap.pending) == (2, 2)
    assert queued(redis_client, OTHER) == {"s2"}  # another dataset's entries are not audited
    assert pending(redis_client, OTHER) == {}
    assert ledger.enqueue(DS, ["s2", "s3"], window=10) == [1, 1]  # fed again


def test_audit_queued_takes_leased_or_done_samples_out_of_the_queued_set_without_making_them_pending(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)
    lease(ledger, "leased")
    commit_new(ledger, "done", 4)
    old = server_ms(redis_client) - OLD_MS
    # stale queued marks (e.g. a message taken by a worker whose admit came after the mark)
    redis_client.zadd(keys().queued_zset, {"leased": old, "done": old, "lost": old})

    assert ledger.audit_queued(DS, QUEUE_NAME, older_than_ms=60_000) == 1

    assert queued(redis_client) == set()
    assert pending(redis_client) == {"lost": "lost_message"}
    assert redis_client.hget(keys().lease_owner_hash, "leased") == "a1"
    snap = ledger.snapshot(DS)
    assert (snap.inflight, snap.samples, snap.queued, snap.pending) == (1, 1, 0, 1)


# --- purge_queue ------------------------------------------------------------------------------------


def test_purge_queue_removes_exactly_one_datasets_messages_and_keeps_the_others_in_order(
    ledger: Ledger, redis_client: redis.Redis, publish: Publish
) -> None:
    make(ledger)
    make(ledger, OTHER)
    assert ledger.enqueue(DS, ["s1", "s2", "s3"], window=10) == [1, 1, 1]
    assert ledger.enqueue(OTHER, ["o1", "o2"], window=10) == [1, 1]
    publish(OTHER, ["o1"])
    publish(DS, ["s1"])
    redis_client.lpush(QUEUE_NAME, "not json {")
    publish(OTHER, ["o2"])
    publish(DS, ["s2", "s3"])
    redis_client.lpush(QUEUE_NAME, json.dumps({"headers": "not a table"}))
    redis_client.lpush(QUEUE_NAME, "[1, 2]")
    # the publisher LPUSHes: the newest message is at the head
    assert queue(redis_client) == [
        "[1, 2]",
        '{"headers": "not a table"}',
        (DS, "s3"),
        (DS, "s2"),
        (OTHER, "o2"),
        "not json {",
        (DS, "s1"),
        (OTHER, "o1"),
    ]
    kept_raw = [raw for raw in redis_client.lrange(QUEUE_NAME, 0, -1) if describe(raw)[0] != DS]

    assert ledger.purge_queue(DS, QUEUE_NAME, "revoked") == 3

    assert redis_client.lrange(QUEUE_NAME, 0, -1) == kept_raw  # byte for byte, in the same order
    assert queue(redis_client) == [
        "[1, 2]",
        '{"headers": "not a table"}',
        (OTHER, "o2"),
        "not json {",
        (OTHER, "o1"),
    ]
    assert queued(redis_client) == set()
    assert pending(redis_client) == {"s1": "revoked", "s2": "revoked", "s3": "revoked"}
    snap = ledger.snapshot(DS)
    assert (snap.queued, snap.pending) == (0, 3)
    assert queued(redis_client, OTHER) == {"o1", "o2"}
    assert pending(redis_client, OTHER) == {}


def test_purge_queue_counts_a_message_whose_sample_is_not_queued_but_does_not_make_it_pending(
    ledger: Ledger, redis_client: redis.Redis, publish: Publish
) -> None:
    make(ledger)
    assert ledger.enqueue(DS, ["s1"], window=10) == [1]
    publish(DS, ["s1", "stale"])  # "stale" published past the ledger, as a stale producer might

    assert ledger.purge_queue(DS, QUEUE_NAME, "paused") == 2

    assert redis_client.llen(QUEUE_NAME) == 0
    assert redis_client.exists(QUEUE_NAME) == 0
    assert pending(redis_client) == {"s1": "paused"}


def test_purge_queue_with_no_message_of_the_dataset_returns_0_and_leaves_the_list_untouched(
    ledger: Ledger, redis_client: redis.Redis, publish: Publish
) -> None:
    make(ledger)
    make(ledger, OTHER)
    assert ledger.enqueue(DS, ["s1"], window=10) == [1]
    publish(OTHER, ["o1", "o2"])
    redis_client.lpush(QUEUE_NAME, "garbage", "{}", "null")
    before = redis_client.lrange(QUEUE_NAME, 0, -1)

    assert ledger.purge_queue(DS, QUEUE_NAME, "revoked") == 0
    assert ledger.purge_queue("nobody", QUEUE_NAME, "revoked") == 0

    assert redis_client.lrange(QUEUE_NAME, 0, -1) == before
    assert queued(redis_client) == {"s1"}
    assert pending(redis_client) == {}


# --- heartbeat and workers --------------------------------------------------------------------------


def test_heartbeat_records_the_facts_with_the_servers_last_seen_ms(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    facts = {"version": "1.2.3+code.abc", "host": "gpu-1", "pid": 4242, "concurrency": None, "inflight": 3}
    t0 = server_ms(redis_client)
    ledger.heartbeat("w1@gpu-1", facts)
    t1 = server_ms(redis_client)

    stored = json.loads(redis_client.hget(WORKERS_HASH, "w1@gpu-1"))
    assert {k: v for k, v in stored.items() if k != "last_seen_ms"} == facts
    assert t0 <= stored["last_seen_ms"] <= t1

    time.sleep(0.02)
    ledger.heartbeat("w1@gpu-1", facts | {"inflight": 1})
    again = json.loads(redis_client.hget(WORKERS_HASH, "w1@gpu-1"))
    assert again["inflight"] == 1
    assert again["last_seen_ms"] > stored["last_seen_ms"]
    assert redis_client.hlen(WORKERS_HASH) == 1


def test_workers_lists_only_those_seen_within_the_window_with_their_age(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    ledger.heartbeat("fresh", {"version": "1", "inflight": 2})
    now = server_ms(redis_client)
    edge_ms = int((WORKER_SEEN_WITHIN_S - 5) * 1000)
    redis_client.hset(
        WORKERS_HASH,
        mapping={
            "edge": json.dumps({"version": "1", "last_seen_ms": now - edge_ms}),
            "stale": json.dumps({"version": "0", "last_seen_ms": now - 45_000}),
        },
    )

    online = ledger.workers()

    assert [w["name"] for w in online] == ["edge", "fresh"]
    by_name = {w["name"]: w for w in online}
    assert 0 <= by_name["fresh"]["age_s"] <= 1
    assert by_name["fresh"]["inflight"] == 2 and by_name["fresh"]["version"] == "1"
    assert by_name["edge"]["age_s"] == pytest.approx(edge_ms / 1000, abs=1)

    everyone = {w["name"]: w for w in ledger.workers(seen_within_s=60)}
    assert set(everyone) == {"edge", "fresh", "stale"}
    assert everyone["stale"]["age_s"] == pytest.approx(45, abs=1)
    assert everyone["stale"]["version"] == "0"
    assert [w["name"] for w in ledger.workers(seen_within_s=10)] == ["fresh"]


def test_heartbeat_with_none_removes_the_worker(ledger: Ledger, redis_client: redis.Redis) -> None:
    ledger.heartbeat("w1", {"version": "1"})
    ledger.heartbeat("w2", {"version": "1"})

    ledger.heartbeat("w1", None)
    ledger.heartbeat("never-seen", None)  # a no-op

    assert set(redis_client.hkeys(WORKERS_HASH)) == {"w2"}
    assert [w["name"] for w in ledger.workers()] == ["w2"]


# --- rates ------------------------------------------------------------------------------------------


def assert_rates(ledger: Ledger, redis_client: redis.Redis, tokens: int, samples: int) -> tuple[float, float]:
    """The snapshot's rates are the rings' sums over the seconds from their oldest entry to now."""
    k = keys()
    tokens_ring, samples_ring = (
        ring(redis_client, k.rate_tokens_hash),
        ring(redis_client, k.rate_samples_hash),
    )
    assert sum(tokens_ring.values()) == tokens
    assert sum(samples_ring.values()) == samples
    assert all(n > 0 for n in [*tokens_ring.values(), *samples_ring.values()])
    t0 = server_s(redis_client)
    snap = ledger.snapshot(DS)
    t1 = server_s(redis_client)
    assert t1 - min(tokens_ring) + 1 <= 3  # the run took a second or two
    # the window runs from the start of its oldest second to the moment of the read (at least 1 s)
    span_s = tokens / snap.tokens_per_s
    assert max(1.0, t0 - min(tokens_ring)) <= span_s <= t1 - min(tokens_ring) + 1
    assert snap.samples_per_s * span_s == pytest.approx(samples)
    return snap.tokens_per_s, snap.samples_per_s


def test_a_new_dataset_has_zero_rates(ledger: Ledger) -> None:
    make(ledger)

    snap = ledger.snapshot(DS)

    assert (snap.tokens_per_s, snap.samples_per_s) == (0.0, 0.0)


def test_live_reports_and_commit_tokens_show_up_in_the_snapshot_rates(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)
    for i in range(5):
        sid = f"s{i}"
        lease(ledger, sid)
        report_live(ledger, sid, "a1", 10)  # reported while it streamed
        assert ledger.commit(DS, sid, "a1", 25) is CommitOutcome.COMMITTED  # 15 more in the last chunk
    lease(ledger, "flying")
    report_live(ledger, "flying", "a1", 7)  # in flight: generated, not committed

    assert_rates(ledger, redis_client, tokens=5 * 25 + 7, samples=5)
    snap = ledger.snapshot(DS)
    assert (snap.tokens, snap.samples, snap.live_tokens) == (125, 5, 7)


def test_a_commit_without_live_reports_counts_all_its_tokens_in_the_rate(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)
    commit_new(ledger, "s1", 40)
    commit_new(ledger, "s2", 2)

    assert_rates(ledger, redis_client, tokens=42, samples=2)


def test_a_lower_live_report_does_not_reduce_the_rate(ledger: Ledger, redis_client: redis.Redis) -> None:
    make(ledger)
    lease(ledger, "s1")
    report_live(ledger, "s1", "a1", 30)
    before, _ = assert_rates(ledger, redis_client, tokens=30, samples=0)

    report_live(ledger, "s1", "a1", 0)  # the try failed and is retried: its tokens are taken back

    assert ledger.snapshot(DS).live_tokens == 0
    after, _ = assert_rates(ledger, redis_client, tokens=30, samples=0)
    assert after >= before

    report_live(ledger, "s1", "a1", 20)  # the retry streams again
    assert ledger.commit(DS, "s1", "a1", 32) is CommitOutcome.COMMITTED

    assert_rates(ledger, redis_client, tokens=30 + 32, samples=1)  # generated, including the lost try
    snap = ledger.snapshot(DS)
    assert (snap.tokens, snap.samples, snap.live_tokens) == (32, 1, 0)


def test_one_samples_lower_live_report_takes_nothing_off_anothers_gain_in_the_same_renew(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)
    lease(ledger, "s1")
    lease(ledger, "s2")
    report_live(ledger, "s1", "a1", 30)

    # s1's try is taken back for a retry while s2 produced 20: 20 more tokens were generated
    assert ledger.renew_many(DS, [("s1", "a1", 0), ("s2", "a1", 20)]) == [True, True]

    assert_rates(ledger, redis_client, tokens=30 + 20, samples=0)
    assert ledger.snapshot(DS).live_tokens == 20


def test_rate_entries_older_than_the_window_are_not_counted(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)
    now = server_s(redis_client)
    redis_client.hset(keys().rate_tokens_hash, mapping={now - RATE_WINDOW_S - 5: 1000})
    redis_client.hset(keys().rate_samples_hash, mapping={now - RATE_WINDOW_S - 5: 10})

    snap = ledger.snapshot(DS)

    assert (snap.tokens_per_s, snap.samples_per_s) == (0.0, 0.0)


#: A second the ring's trim is looked at in (one in every 16), and one it is not: ``rate_add`` is driven
#: directly with a chosen second, as the scripts' clock cannot be set.
TRIM_SECOND = 1_000_000_000  # a multiple of 16
OTHER_SECOND = TRIM_SECOND + 1


def rate_add(redis_client: redis.Redis, key: str, n: int, sec: int) -> None:
    """Call ``_lib.lua``'s ``rate_add`` for ring ``key`` as if it were second ``sec``."""
    lib = (resources.files("budget") / "lua" / "_lib.lua").read_text()
    redis_client.eval(
        f"{lib}\nrate_add(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]))\nreturn 1", 1, key, n, sec
    )


def fill_ring(redis_client: redis.Redis, key: str, sec: int, old: int) -> int:
    """``old`` entries long before ``sec`` and one 60 s before it; returns that one's second."""
    recent = sec - 60  # within the 120 s kept
    redis_client.hset(key, mapping={**{sec - 1000 - i: 3 for i in range(old)}, recent: 1000})
    return recent


def test_a_rate_ring_past_240_entries_is_trimmed_to_the_last_120_seconds_in_a_trim_second(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    key = keys().rate_tokens_hash
    recent = fill_ring(redis_client, key, TRIM_SECOND, old=239)

    rate_add(redis_client, key, 5, TRIM_SECOND)  # 241 entries: past 240, trimmed

    assert ring(redis_client, key) == {recent: 1000, TRIM_SECOND: 5}


def test_a_rate_ring_is_not_looked_at_for_trimming_outside_a_trim_second(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    key = keys().rate_samples_hash
    fill_ring(redis_client, key, OTHER_SECOND, old=239)

    rate_add(redis_client, key, 1, OTHER_SECOND)

    assert redis_client.hlen(key) == 241
    assert ring(redis_client, key)[OTHER_SECOND] == 1


def test_a_rate_ring_is_not_trimmed_at_240_entries(ledger: Ledger, redis_client: redis.Redis) -> None:
    key = keys().rate_tokens_hash
    fill_ring(redis_client, key, TRIM_SECOND, old=238)

    rate_add(redis_client, key, 5, TRIM_SECOND)  # 240 entries: not yet past twice the 120 s kept

    assert redis_client.hlen(key) == 240


def test_rate_add_of_nothing_writes_nothing(ledger: Ledger, redis_client: redis.Redis) -> None:
    key = keys().rate_tokens_hash

    rate_add(redis_client, key, 0, TRIM_SECOND)
    rate_add(redis_client, key, -7, TRIM_SECOND)

    assert redis_client.exists(key) == 0


# --- rebuild ----------------------------------------------------------------------------------------


def test_rebuild_replaces_done_failed_and_counters_and_clears_queued_leases_and_pending(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=10_000)
    commit_new(ledger, "old1", 11)
    commit_new(ledger, "old2", 12)
    ledger.fail(DS, "oldfail", "x", "HTTP 400")
    lease(ledger, "flying")
    report_live(ledger, "flying", "a1", 9)
    lease(ledger, "struck")
    assert ledger.give_up(DS, "struck", "a1", "timeout") == "pending"
    assert ledger.enqueue(DS, ["q1", "q2"], window=10) == [1, 1]
    done = {"a": "att-a", "b": "att-b", "c": "att-c"}

    state = ledger.rebuild(DS, done=done, tokens=300, truncated=1, failed={"x": "bad prompt"})

    assert state == DatasetState.ACTIVE
    assert ledger.done_attempts(DS) == done
    assert ledger.failures(DS) == {"x": "bad prompt"}
    snap = ledger.snapshot(DS)
    assert (snap.tokens, snap.samples, snap.truncated, snap.live_tokens, snap.reserved_tokens) == (
        300,
        3,
        1,
        0,
        0,
    )
    assert (snap.failed, snap.queued, snap.inflight, snap.pending) == (1, 0, 0, 0)
    k = keys()
    for key in (
        k.queued_zset,
        k.lease_zset,
        k.lease_owner_hash,
        k.live_hash,
        k.reserved_hash,
        k.pending_hash,
        k.strikes_hash,
    ):
        assert redis_client.exists(key) == 0, key
    assert ledger.admit(DS, "flying", "a2").admission is Admission.OK  # its lease is gone
    assert ledger.admit(DS, "old1", "a2").admission is Admission.OK  # not in the files: not done


def test_rebuild_re_applies_the_token_budget(ledger: Ledger) -> None:
    make(ledger, token_budget=100)

    assert ledger.rebuild(DS, done={"a": "1", "b": "2"}, tokens=100, truncated=0, failed={}) == "exhausted"
    assert ledger.snapshot(DS).state == DatasetState.EXHAUSTED

    assert ledger.rebuild(DS, done={"a": "1"}, tokens=60, truncated=0, failed={}) == "active"
    assert ledger.snapshot(DS).state == DatasetState.ACTIVE


def test_rebuild_re_applies_max_samples(ledger: Ledger) -> None:
    make(ledger, max_samples=2)

    assert ledger.rebuild(DS, done={"a": "1"}, tokens=5, truncated=0, failed={}) == "active"
    assert ledger.rebuild(DS, done={"a": "1", "b": "2"}, tokens=9, truncated=0, failed={}) == "exhausted"
    assert ledger.enqueue(DS, ["c"], window=10) == [-2]


def test_rebuild_keeps_a_paused_dataset_paused(ledger: Ledger) -> None:
    make(ledger, token_budget=100)
    ledger.pause(DS)

    assert ledger.rebuild(DS, done={"a": "1"}, tokens=500, truncated=0, failed={}) == "paused"


def test_rebuild_with_small_chunks_writes_every_entry(ledger: Ledger) -> None:
    make(ledger)
    done = {f"s{i}": f"a{i}" for i in range(25)}
    failed = {f"f{i}": "HTTP 400" for i in range(7)}

    ledger.rebuild(DS, done=done, tokens=250, truncated=0, failed=failed, chunk=4)

    assert ledger.done_attempts(DS) == done
    assert ledger.failures(DS) == failed
    assert ledger.snapshot(DS).samples == 25


# --- commit after revoke ----------------------------------------------------------------------------


def test_commit_after_revoke_answers_revoked_does_not_count_and_makes_the_sample_pending(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)
    commit_new(ledger, "s0", 3)
    lease(ledger, "s1")
    report_live(ledger, "s1", "a1", 10)
    assert ledger.revoke(DS) == DatasetState.REVOKED

    assert ledger.commit(DS, "s1", "a1", 12) is CommitOutcome.REVOKED

    snap = ledger.snapshot(DS)
    assert (snap.state, snap.tokens, snap.samples) == (DatasetState.REVOKED, 3, 1)
    assert (snap.live_tokens, snap.inflight, snap.wasted_tokens, snap.pending) == (0, 0, 12, 1)
    assert ledger.done_attempts(DS) == {"s0": "s0-a1"}
    assert pending(redis_client) == {"s1": "revoked"}
    assert redis_client.hget(keys().lease_owner_hash, "s1") is None

    assert ledger.resume(DS) == DatasetState.ACTIVE
    assert ledger.enqueue(DS, ["s1"], window=10) == [1]  # fed again once resumed


def test_purge_and_audit_read_the_sample_ids_of_group_tasks(
    ledger: Ledger, redis_client: redis.Redis, redis_url: str
) -> None:
    from workers.app import make_app

    make(ledger)
    ids = [f"g{i}" for i in range(7)]
    assert ledger.enqueue(DS, ids, window=10) == [1] * 7
    app = make_app(redis_url)
    TaskPublisher(app, samples_per_task=3)(
        DS, [Sample(sid, i + 1, [1, 2], None, {}) for i, sid in enumerate(ids)]
    )
    app.close()
    assert redis_client.llen(QUEUE_NAME) == 3  # groups of 3, 3 and 1

    assert ledger.audit_queued(DS, QUEUE_NAME, older_than_ms=0) == 0  # every id is found in a group's header
    assert ledger.purge_queue(DS, QUEUE_NAME, "revoked") == 3

    assert redis_client.llen(QUEUE_NAME) == 0
    assert queued(redis_client) == set()
    assert pending(redis_client) == dict.fromkeys(ids, "revoked")
