"""How soon submit looks again near a run's end: the expected end from the last round's snapshots."""

from __future__ import annotations

import math
from typing import Any, cast

from producer.feeder import Feeder
from tests.support.snapshots import snapshot_of


def feeder_after_round(*snaps: Any) -> Feeder:
    feeder = Feeder(cast(Any, None), lambda name, samples: None, [])
    feeder.last_snapshots = list(snaps)
    return feeder


def test_the_expected_end_is_what_is_queued_and_in_flight_at_the_commit_rate_of_every_dataset() -> None:
    busy = snapshot_of("a", queued=512, inflight=256, samples_per_s=80.0)
    ending = snapshot_of("b", queued=0, inflight=8, samples_per_s=16.0)

    assert feeder_after_round(busy).expected_end_s() == 768 / 80
    assert feeder_after_round(busy, ending).expected_end_s() == (768 + 8) / 96


def test_no_end_is_expected_while_nothing_commits() -> None:
    stuck = snapshot_of(queued=10, inflight=4, samples_per_s=0.0)

    assert feeder_after_round(stuck).expected_end_s() == math.inf
    assert feeder_after_round().expected_end_s() == math.inf
