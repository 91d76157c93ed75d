"""The feeder across a Redis outage at the end of its pass: the dataset still settles."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest

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
