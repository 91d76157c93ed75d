"""The worker's CallBatcher: calls of many threads answered by one batched call, each with its own answer;
a lingering batch waits for ``target_batch`` calls up to ``max_linger_s``, and never for calls that cannot
come."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from workers.batching import CallBatcher


class Recorder:
    """A batch runner that records the batches it got and answers each item with its double."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.lock = threading.Lock()

    def __call__(self, key: str, items: Sequence[int]) -> list[int]:
        with self.lock:
            self.batches.append(list(items))
        return [2 * i for i in items]


def call_from_threads(batcher: CallBatcher[str, int, int], items: list[int]) -> dict[int, int]:
    answers: dict[int, int] = {}

    def one(i: int) -> None:
        answers[i] = batcher.call("k", i)

    threads = [threading.Thread(target=one, args=(i,)) for i in items]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return answers


def test_calls_that_arrive_while_a_batch_lingers_share_one_run_and_each_gets_its_own_answer() -> None:
    run = Recorder()
    batcher: CallBatcher[str, int, int] = CallBatcher("t", run, linger_s=1.0)

    answers = call_from_threads(batcher, list(range(10)))

    assert answers == {i: 2 * i for i in range(10)}
    assert sorted(i for b in run.batches for i in b) == list(range(10))
    assert len(run.batches) < 10


def test_a_batch_runs_at_once_when_every_caller_that_may_still_call_is_queued() -> None:
    run = Recorder()
    # a linger far longer than the join below: only the callers check can answer in time
    batcher: CallBatcher[str, int, int] = CallBatcher(
        "t", run, linger_s=60.0, max_linger_s=60.0, callers=lambda: 3
    )

    answers = call_from_threads(batcher, [1, 2, 3])

    assert answers == {1: 2, 2: 4, 3: 6}


def test_a_lingering_batch_runs_once_target_batch_calls_are_queued() -> None:
    run = Recorder()
    # others may still call (100 in flight) and it could wait a minute, but 4 calls are enough
    batcher: CallBatcher[str, int, int] = CallBatcher(
        "t", run, linger_s=0.01, max_linger_s=60.0, target_batch=4, callers=lambda: 100
    )

    answers = call_from_threads(batcher, [1, 2, 3, 4])

    assert answers == {1: 2, 2: 4, 3: 6, 4: 8}


def test_a_trickle_of_calls_waits_at_most_max_linger_then_runs_as_one_batch() -> None:
    run = Recorder()
    batcher: CallBatcher[str, int, int] = CallBatcher(
        "t", run, linger_s=0.01, max_linger_s=0.5, target_batch=100, callers=lambda: 100
    )

    answers = call_from_threads(batcher, [1, 2])

    assert answers == {1: 2, 2: 4}
    assert sorted(i for b in run.batches for i in b) == [1, 2]
