"""The feeder counts the whole source of a dataset that a limit or a revoke stopped before its pass read it
all (reading on without feeding), so that every source sample is accounted for: `status` says how many were
never fed."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import orjson
import pytest

from budget import DatasetState, Ledger
from producer import feeder as feeder_module
from producer.feeder import DatasetFeed, Feeder
from producer.source import Sample
from tests.support.ledger import DS, commit_new, make
from tokenfleet.status_view import unfed

pytestmark = pytest.mark.redis

TOKENS = 20


def write_source(path: Path, n: int, extra: Sequence[bytes] = ()) -> Path:
    lines = [orjson.dumps({"id": f"s{i:04d}", "input_ids": [1, 2, i]}) for i in range(n)]
    path.write_bytes(b"".join(line + b"\n" for line in [*lines, *extra]))
    return path


class Workers:
    """Publishing as a fleet that generates and commits each published sample at once."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.published: dict[str, list[str]] = {}

    def __call__(self, name: str, samples: Sequence[Sample]) -> None:
        for s in samples:
            self.published.setdefault(name, []).append(s.sample_id)
            commit_new(self.ledger, s.sample_id, TOKENS, name=name)


def run_rounds(feeder: Feeder, most: int = 200) -> None:
    for _ in range(most):
        if feeder.step():
            return
    raise AssertionError(f"not settled after {most} rounds: {feeder.last_snapshots}")


def test_a_discard_dataset_exhausted_before_its_source_is_read_ends_with_its_source_counted(
    ledger: Ledger, tmp_path: Path
) -> None:
    make(ledger, token_budget=10 * TOKENS, on_budget="discard")
    n = 100
    # past the point the budget stops it: a bad line and a repeated id, rejected as a first pass rejects them
    repeated = orjson.dumps({"id": "s0001", "text": "x"})
    source = write_source(tmp_path / "src.jsonl", n, [b"not json", repeated])
    rejected = tmp_path / "rejected.jsonl"
    workers = Workers(ledger)
    feeder = Feeder(ledger, workers, [DatasetFeed(DS, source, rejected)], window=8, batch=4)

    run_rounds(feeder)

    snap = ledger.snapshot(DS)
    fed = len(workers.published[DS])
    assert snap.state == DatasetState.EXHAUSTED and snap.settled
    assert fed == snap.samples < n  # the budget stopped it early, and nothing was fed after
    assert snap.source_done and (snap.source_total, snap.rejected) == (n, 2)
    assert [orjson.loads(line)["line"] for line in rejected.read_bytes().splitlines()] == [n + 1, n + 2]
    # every source sample is in a category: committed, failed, dropped, queued, in flight, or never fed
    never_fed = unfed(snap)
    assert never_fed == n - snap.samples
    assert snap.samples + snap.failed + snap.pending + snap.queued + snap.inflight + never_fed == n


def test_a_dataset_stopped_before_this_run_fed_it_still_has_its_source_counted(
    ledger: Ledger, tmp_path: Path
) -> None:
    make(ledger)
    ledger.set_state(DS, "revoke")
    workers = Workers(ledger)
    feed = DatasetFeed(DS, write_source(tmp_path / "src.jsonl", 30), tmp_path / "rejected.jsonl")
    feeder = Feeder(ledger, workers, [feed], window=8, batch=4)

    run_rounds(feeder)

    snap = ledger.snapshot(DS)
    assert workers.published == {}
    assert snap.source_done and snap.source_total == 30 and unfed(snap) == 30


def test_a_stopped_datasets_source_is_counted_a_slice_a_round_while_the_others_are_fed_in_full(
    ledger: Ledger, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(feeder_module, "COUNT_SLICE_S", 0.0)  # a slice reads one line
    make(ledger, "stopped")
    make(ledger, "fed")
    ledger.set_state("stopped", "revoke")
    workers = Workers(ledger)
    feeds = [
        DatasetFeed("stopped", write_source(tmp_path / "stopped.jsonl", 50), tmp_path / "stopped.rej"),
        DatasetFeed("fed", write_source(tmp_path / "fed.jsonl", 50), tmp_path / "fed.rej"),
    ]
    feeder = Feeder(ledger, workers, feeds, window=8, batch=4)

    assert not feeder.step()
    # the active dataset had its whole window this round; the stopped one's count goes on next round
    assert len(workers.published["fed"]) == 8
    assert feeder.counting and not ledger.snapshot("stopped").source_done

    run_rounds(feeder)

    assert not feeder.counting and "stopped" not in workers.published
    stopped, fed = ledger.snapshot("stopped"), ledger.snapshot("fed")
    assert stopped.source_done and stopped.source_total == 50 and unfed(stopped) == 50
    assert fed.source_done and fed.samples == fed.source_total == 50


def test_a_dataset_revoked_mid_pass_then_resumed_is_fed_the_samples_its_pass_only_counted(
    ledger: Ledger, tmp_path: Path
) -> None:
    make(ledger)
    n = 40
    workers = Workers(ledger)
    feed = DatasetFeed(DS, write_source(tmp_path / "src.jsonl", n), tmp_path / "rejected.jsonl")
    feeder = Feeder(ledger, workers, [feed], window=8, batch=4)
    feeder.step()
    ledger.set_state(DS, "revoke")

    run_rounds(feeder)
    counted = ledger.snapshot(DS)
    assert counted.source_done and counted.source_total == n and unfed(counted) == n - counted.samples > 0

    ledger.set_state(DS, "resume")
    assert not feeder.step()  # what the pass only counted is not fed yet: not settled

    run_rounds(feeder)
    snap = ledger.snapshot(DS)
    assert snap.settled and snap.source_done and snap.source_total == n
    assert sorted(workers.published[DS]) == [f"s{i:04d}" for i in range(n)]  # each fed once
    assert snap.samples == n and unfed(snap) == 0
