"""The feeder across a Redis outage: at the end of its pass the dataset still settles; across a restart that
lost the ledger mid-feed (no persistence) every source line is still accounted for, none as a duplicate."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from budget import Ledger, LedgerUnavailable
from producer.feeder import DatasetFeed, Feeder
from producer.source import Sample
from tests.support.ledger import DS, commit_new, make

pytestmark = pytest.mark.redis


class OutageAtSetSource:
    """The real ledger, but Redis is away for the first ``set_source`` (a restart at the pass's end)."""

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        self.failed = 0

    def set_source(self, *args: Any, **kwargs: Any) -> None:
        if self.failed == 0:
            self.failed += 1
            raise LedgerUnavailable("Redis is unreachable (test: restarting)")
        self._ledger.set_source(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ledger, name)


def test_a_redis_outage_as_the_pass_ends_still_records_the_source_done_and_the_dataset_settles(
    ledger: Ledger, tmp_path: Path
) -> None:
    make(ledger)
    source = tmp_path / "src.jsonl"
    source.write_bytes(
        b"".join(orjson.dumps({"id": f"s{i}", "input_ids": [1, 2, i]}) + b"\n" for i in range(3))
    )
    flaky = OutageAtSetSource(ledger)

    def publish(name: str, samples: Sequence[Sample]) -> None:
        # the workers: each published sample is generated and committed at once
        for s in samples:
            commit_new(ledger, s.sample_id, 5, name=name)

    feed = DatasetFeed(DS, source, tmp_path / "rejected.jsonl")
    feeder = Feeder(flaky, publish, [feed])  # type: ignore[arg-type]

    with pytest.raises(LedgerUnavailable):
        feeder.step()
    assert not ledger.snapshot(DS).source_done
    assert not feed.pass_complete

    for _ in range(3):
        if feeder.step():
            break
    snap = ledger.snapshot(DS)
    assert snap.source_done and snap.samples == 3
    assert feeder.step()
    assert flaky.failed == 1


def test_a_ledger_lost_mid_feed_is_fed_again_from_a_clean_first_pass_losing_no_line_as_a_duplicate(
    ledger: Ledger, redis_client: redis.Redis, tmp_path: Path
) -> None:
    make(ledger)
    n = 40
    source = tmp_path / "src.jsonl"
    source.write_bytes(
        b"".join(orjson.dumps({"id": f"a-{i:05d}", "input_ids": [1, 2, i]}) + b"\n" for i in range(n))
    )
    rejected = tmp_path / "rejected.jsonl"
    exported: list[str] = []  # the output files: what survives a restart of a Redis without persistence
    calls = 0

    def publish(name: str, samples: Sequence[Sample]) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            # Redis restarts: the ledger and the queue are gone, these samples with them (never generated)
            redis_client.flushdb()
            return
        for s in samples:  # the workers generate and export each at once
            commit_new(ledger, s.sample_id, 5, name=name)
            exported.append(s.sample_id)

    def rebuild() -> None:
        """What submit does (``adopt_outputs``): register the dataset again, its exported samples done."""
        make(ledger)
        for sid in exported:
            commit_new(ledger, sid, 5)

    feed = DatasetFeed(DS, source, rejected)
    feeder = Feeder(ledger, publish, [feed], window=8, batch=4)

    feeder.run(on_lost_ledger=rebuild)

    assert calls > 2  # the restart came mid-feed, after the first pass had read the lines of two batches
    assert rejected.read_bytes() == b""  # no line taken for a duplicate of one read before the restart
    snap = ledger.snapshot(DS)
    assert snap.settled and snap.source_done
    assert (snap.source_total, snap.rejected) == (n, 0)
    # every source line ends exported, none twice
    assert sorted(exported) == [f"a-{i:05d}" for i in range(n)]
    assert (snap.samples, snap.failed, snap.pending, snap.queued, snap.inflight) == (n, 0, 0, 0, 0)
