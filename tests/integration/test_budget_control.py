"""Exact budgets and live control: policies at the budget, pause/resume, re-budget, revoke, purge."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from budget import DatasetLimits, Ledger
from producer.source import Sample
from tests.support.files import unique, write_config
from tests.support.fleet import BackgroundSubmit, PrivateFleet, Sim, export, token_rows, wait_until
from tokenfleet import control
from tokenfleet.cli import main
from tokenfleet.publish import TaskPublisher
from tokenfleet.sim.engine import SamplingSpec, plan_output, tokenize
from workers.messages import QUEUE_NAME
from workers.rids import dataset_tag

pytestmark = pytest.mark.integration


def generated_for(sim: Sim, dataset: str) -> int:
    return int(sim.stats()["by_prefix"].get(dataset_tag(dataset), 0))


@pytest.fixture
def slow_sim(sim_factory: Callable[..., Sim]) -> Sim:
    # ~200 tokens per answer at 200 tokens/s per stream: generations last about a second.
    return sim_factory(step_time_s=0.005, output_len_mean=200.0, output_len_sigma=0.6)


#: max_new_tokens of the budget runs: about 2.5 times the mean answer. A generation is granted part of it
#: near the budget's end and continued in new requests as the budget allows (workers/continuation.py).
BUDGET_RUN_MAX_NEW = 512


def budget_run(
    policy: str,
    fleet_redis_url: str,
    fleet_ledger: Ledger,
    sim: Sim,
    tmp_path: Path,
    budget: int = 20_000,
    rows: list[dict[str, Any]] | None = None,
) -> tuple[str, list[dict[str, Any]]]:
    name = unique(policy)
    rows = token_rows(400, seed=5) if rows is None else rows
    config = write_config(
        tmp_path,
        redis_url=fleet_redis_url,
        servers=[sim.url],
        datasets=[{"name": name, "rows": rows, "token_budget": budget, "on_budget": policy}],
        sampling={"max_new_tokens": BUDGET_RUN_MAX_NEW},
    )
    assert main(["submit", str(config), "--no-server-check", "--window", "32"]) == 0
    return name, export(fleet_ledger, name, tmp_path)


def test_truncate_spends_the_budget_exactly_and_marks_the_generations_cut_by_their_reservation(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, slow_sim: Sim, tmp_path: Path
) -> None:
    name, records = budget_run("truncate", fleet_redis_url, fleet_ledger, slow_sim, tmp_path)

    snap = fleet_ledger.snapshot(name)
    generated = generated_for(slow_sim, name)
    exported = sum(r["completion_tokens"] for r in records)
    truncated = [r for r in records if r["truncated"]]
    assert snap.state == "exhausted"
    # Each generation was sent with max_new_tokens at most its reservation: the server itself stopped
    # at the budget, so nothing past it was generated and nothing generated was thrown away.
    assert snap.tokens == exported == generated == 20_000
    assert snap.reserved_tokens == 0 and snap.wasted_tokens == 0
    # The generations cut at the budget ended at their (smaller) reservation, not at max_new_tokens.
    assert truncated and all(
        r["finish_reason"]["type"] == "length" and r["completion_tokens"] < BUDGET_RUN_MAX_NEW
        for r in truncated
    )
    assert snap.truncated == len(truncated)


def test_a_discard_budgets_first_answers_report_their_tokens_while_they_run_on_a_worker_that_knows_the_server(
    private_fleet: Callable[..., PrivateFleet], sim_factory: Callable[..., Sim], tmp_path: Path
) -> None:
    """Discard admits from the tokens its running answers have produced while fewer are committed than
    run (``live_wanted_soon``). A worker that has measured a server asks it for a chunk about every
    quarter stall timeout, longer than most answers: their tokens reached the ledger only at their end,
    and the first, short answers to end were the measure of every answer (three budgets sharing a server
    threw away 62% of the first one's). The worker now counts them at the speed one stream got on the
    server between their chunks."""
    fleet = private_fleet()
    fleet.start_worker("measured")  # one process: the one that measures the server runs the budget
    ledger = fleet.ledger()
    sim = sim_factory(step_time_s=0.01, output_len_mean=100.0, output_len_sigma=0.1)  # 100 tokens/s
    config = write_config(
        tmp_path,
        redis_url=fleet.url,
        servers=[sim.url],
        datasets=[{"name": unique("warm"), "rows": token_rows(4)}],
    )
    assert main(["submit", str(config), "--no-server-check"]) == 0  # the worker has measured the server
    sim.configure(output_len_mean=1000.0)  # answers of 10 s
    name = unique("discard")
    budget = {"token_budget": 1_000_000, "on_budget": "discard"}
    config = write_config(
        tmp_path,
        redis_url=fleet.url,
        servers=[sim.url],
        datasets=[{"name": name, "rows": token_rows(2, seed=3)} | budget],
        sampling={"max_new_tokens": 4096},
    )
    run = BackgroundSubmit(config)
    wait_until(lambda: name in ledger.datasets() and ledger.snapshot(name).inflight == 2)
    time.sleep(4.0)  # the answers have produced some 400 tokens each, and none has ended

    seen = ledger.snapshot(name)
    generated = generated_for(sim, name)

    assert seen.samples == 0, seen
    # most of what the server generated is in the ledger (counted from the chunks alone, only the first
    # tokens were: 2 of 818 after 4 s)
    assert seen.live_tokens >= 0.5 * generated, (seen.live_tokens, generated)

    assert main(["revoke", name, "--redis-url", fleet.url]) == 0
    assert run.wait() == 0


def test_discard_keeps_only_whole_answers_within_the_budget_and_its_one_percent_slack(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, slow_sim: Sim, tmp_path: Path
) -> None:
    name, records = budget_run("discard", fleet_redis_url, fleet_ledger, slow_sim, tmp_path)

    snap = fleet_ledger.snapshot(name)
    assert snap.state == "exhausted"
    assert records and not any(r["truncated"] for r in records)
    assert all(r["finish_reason"]["type"] in ("stop", "length") for r in records)
    # Whole answers only: what is exported is what was committed; what the server generated besides is
    # the answers that would have passed the budget's 1% slack, thrown away whole (wasted), nothing else.
    assert snap.tokens == sum(r["completion_tokens"] for r in records)
    assert generated_for(slow_sim, name) == snap.tokens + snap.wasted_tokens
    # admission stops once the answers in flight are expected to fill the budget; an answer that would
    # pass its 1% slack is not kept, and what still ran then was stopped: all of it thrown away whole
    # and counted against the budget (how much is a bench figure: docs/budgets.md)
    assert snap.discarded_tokens == snap.wasted_tokens
    assert 20_000 - BUDGET_RUN_MAX_NEW < snap.tokens <= 20_200


def test_an_answer_continued_past_its_grants_is_the_answer_one_uncapped_request_gives(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, slow_sim: Sim, tmp_path: Path
) -> None:
    # A budget far below what 400 answers want: grants are a share of what is left, so most answers
    # longer than their first grant are continued, some several times, before the budget ends.
    name, records = budget_run("truncate", fleet_redis_url, fleet_ledger, slow_sim, tmp_path)
    stats = slow_sim.stats()
    requests = int(stats["requests_by_prefix"].get(dataset_tag(name), 0))
    assert requests > len(records) + 20  # continuations happened (and retries are rare here)

    # The simulator plans an answer from its prompt (as a model samples one); a continuation's prompt is
    # the prompt and the answer so far, and must go on with the same plan: every answer the budget did
    # not cut is exactly the one a single request with the dataset's max_new_tokens gives.
    config = slow_sim.server.config
    whole = [r for r in records if not r["truncated"]]
    assert len(whole) > 30
    for r in whole:
        plan = plan_output(r["input_ids"], SamplingSpec(max_new_tokens=BUDGET_RUN_MAX_NEW), config)
        assert r["output_ids"] == list(plan.token_ids), r["id"]
        assert r["finish_reason"] == plan.finish_reason
    # and the cut ones are its beginning
    for r in records:
        if r["truncated"]:
            plan = plan_output(r["input_ids"], SamplingSpec(max_new_tokens=BUDGET_RUN_MAX_NEW), config)
            assert r["output_ids"] == list(plan.token_ids[: len(r["output_ids"])])


def test_a_text_prompt_is_continued_past_its_grants_as_the_server_tokenized_it(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, slow_sim: Sim, tmp_path: Path
) -> None:
    # Text prompts, half the dataset, among prompts of ids: both are granted shares of what is left and
    # continued (the text ones with the ids the server's /tokenize gives), so none takes the budget
    # from the others and answers are cut only at its end.
    rows = [
        {"id": f"t{i}", "text": f"prompt number {i}: say something long"} if i % 2 else row
        for i, row in enumerate(token_rows(400, seed=5))
    ]
    name, records = budget_run("truncate", fleet_redis_url, fleet_ledger, slow_sim, tmp_path, rows=rows)

    snap = fleet_ledger.snapshot(name)
    assert snap.tokens == generated_for(slow_sim, name) == 20_000  # the whole budget, exactly
    config = slow_sim.server.config
    texts = [r for r in records if r["input_ids"] is None]
    continued = [r for r in texts if r["requests"] > 1]
    assert texts and continued  # text answers went on past their grants
    for r in [r for r in texts if not r["truncated"]]:
        text = f"prompt number {r['id'][1:]}: say something long"
        plan = plan_output(
            tokenize(text, config.vocab_size), SamplingSpec(max_new_tokens=BUDGET_RUN_MAX_NEW), config
        )
        assert r["output_ids"] == list(plan.token_ids), r["id"]
    # cut only at the budget's end: at most one answer per slot the server runs
    assert sum(r["truncated"] for r in records) <= config.batch_size


def test_drain_lets_in_flight_generations_finish_with_complete_answers(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, slow_sim: Sim, tmp_path: Path
) -> None:
    name, records = budget_run("drain", fleet_redis_url, fleet_ledger, slow_sim, tmp_path)

    snap = fleet_ledger.snapshot(name)
    assert snap.state == "exhausted"
    assert all(r["finish_reason"]["type"] in ("stop", "length") and not r["truncated"] for r in records)
    assert snap.tokens == sum(r["completion_tokens"] for r in records) >= 20_000
    assert snap.discarded_tokens == 0


def test_pause_starts_no_generation_and_resume_loses_nothing(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, sim_factory: Callable[..., Sim], tmp_path: Path
) -> None:
    sim = sim_factory(step_time_s=0.004, output_len_mean=60.0)
    name = unique("paused")
    config = write_config(
        tmp_path,
        redis_url=fleet_redis_url,
        servers=[sim.url],
        datasets=[{"name": name, "rows": token_rows(200)}],
    )
    run = BackgroundSubmit(config, "--window", "64")
    wait_until(lambda: name in fleet_ledger.datasets() and fleet_ledger.snapshot(name).samples >= 20)

    assert main(["pause", name, "--redis-url", fleet_redis_url]) == 0
    wait_until(lambda: fleet_ledger.snapshot(name).inflight == 0, what="in-flight generations to finish")
    paused = fleet_ledger.snapshot(name)
    requests = sim.stats()["requests"]
    time.sleep(1.0)
    assert paused.queued == 0  # the waiting tasks were purged into pending
    assert sim.stats()["requests"] == requests  # no generation started while paused
    assert fleet_ledger.snapshot(name).samples == paused.samples

    assert main(["resume", name, "--redis-url", fleet_redis_url]) == 0
    assert run.wait() == 0

    snap = fleet_ledger.snapshot(name)
    records = export(fleet_ledger, name, tmp_path)
    assert snap.samples == len(records) == 200 and snap.pending == 0
    assert len({r["id"] for r in records}) == 200


def test_raising_the_budget_of_an_exhausted_dataset_makes_a_running_submit_feed_it_again(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, sim_factory: Callable[..., Sim], tmp_path: Path
) -> None:
    sim = sim_factory(step_time_s=0.004, output_len_mean=40.0, max_running_requests=16)
    small, companion = unique("small_budget"), unique("companion")
    config = write_config(
        tmp_path,
        redis_url=fleet_redis_url,
        servers=[sim.url],
        datasets=[
            {"name": small, "rows": token_rows(300, seed=2), "token_budget": 500},
            {"name": companion, "rows": token_rows(400, seed=3), "max_samples": 400},
        ],
    )
    run = BackgroundSubmit(config, "--window", "16")
    # The companion keeps the submit running: paused (never settled) until the raised budget is spent.
    # (Left to run, it could finish before the small budget's tail did, and the submit with it.)
    wait_until(lambda: companion in fleet_ledger.datasets(), what="the companion registered")
    assert main(["pause", companion, "--redis-url", fleet_redis_url]) == 0
    wait_until(lambda: small in fleet_ledger.datasets() and fleet_ledger.snapshot(small).state == "exhausted")
    exhausted_at = fleet_ledger.snapshot(small).samples
    assert run.thread.is_alive()

    assert main(["budget", small, "3000", "--redis-url", fleet_redis_url]) == 0
    wait_until(
        lambda: (
            fleet_ledger.snapshot(small).state == "exhausted" and fleet_ledger.snapshot(small).tokens >= 3000
        ),
        what="the raised budget spent by the running submit",
    )
    assert main(["resume", companion, "--redis-url", fleet_redis_url]) == 0
    assert run.wait() == 0

    snap = fleet_ledger.snapshot(small)
    assert snap.state == "exhausted" and snap.token_budget == 3000
    assert snap.tokens >= 3000 and snap.samples > exhausted_at
    assert fleet_ledger.snapshot(companion).samples == 400


def test_revoke_stops_the_datasets_generation_within_2_seconds_and_the_others_go_on(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, slow_sim: Sim, tmp_path: Path
) -> None:
    revoked, other = unique("revoked"), unique("other")
    config = write_config(
        tmp_path,
        redis_url=fleet_redis_url,
        servers=[slow_sim.url],
        datasets=[
            {"name": revoked, "rows": token_rows(300, seed=8)},
            {"name": other, "rows": token_rows(300, seed=9), "max_samples": 40},
        ],
        sampling={"max_new_tokens": 1024},
    )
    run = BackgroundSubmit(config, "--window", "32")
    wait_until(lambda: revoked in fleet_ledger.datasets() and fleet_ledger.snapshot(revoked).samples >= 5)

    assert main(["revoke", revoked, "--redis-url", fleet_redis_url]) == 0
    committed_at_revoke = fleet_ledger.snapshot(revoked).samples
    time.sleep(2.0)
    generated_at_2s = generated_for(slow_sim, revoked)
    time.sleep(2.0)

    assert generated_for(slow_sim, revoked) == generated_at_2s
    assert run.wait() == 0
    assert fleet_ledger.snapshot(revoked).state == "revoked"
    assert fleet_ledger.snapshot(revoked).samples == committed_at_revoke
    assert len(export(fleet_ledger, revoked, tmp_path)) == committed_at_revoke
    assert fleet_ledger.snapshot(other).samples == 40


@pytest.fixture
def idle_broker() -> Iterator[tuple[str, Ledger]]:
    """A Redis database with a queue no worker reads, to count what a purge leaves."""
    url = os.environ.get("TOKENFLEET_TEST_IDLE_REDIS_URL", "redis://127.0.0.1:6379/13")
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        client.ping()
    except redis.ConnectionError as e:
        pytest.skip(f"no Redis at {url}: {e}")
    client.flushdb()
    yield url, Ledger(client)
    client.flushdb()
    client.close()


def test_revoking_a_dataset_drops_10000_queued_tasks_within_5_seconds_and_keeps_the_others(
    idle_broker: tuple[str, Ledger],
) -> None:
    from workers.app import make_app

    url, ledger = idle_broker
    app = make_app(url)
    ledger.register("big", DatasetLimits(), {"servers": []})
    ledger.register("kept", DatasetLimits(), {"servers": []})
    publish = TaskPublisher(app)
    for name, n in (("big", 10_000), ("kept", 100)):
        samples = [Sample(f"{name}-{i}", i + 1, [3, 4, 5], None, {}) for i in range(n)]
        for start in range(0, n, 1000):
            batch = samples[start : start + 1000]
            assert ledger.enqueue(name, [s.sample_id for s in batch], 20_000) == [1] * len(batch)
            publish(name, batch)
    assert ledger.client.llen(QUEUE_NAME) == 10_100

    started = time.monotonic()
    state, purged = control.revoke(ledger, "big")
    elapsed = time.monotonic() - started

    assert state == "revoked" and purged == 10_000
    assert elapsed <= 5.0, f"purge took {elapsed:.2f} s"
    assert ledger.client.llen(QUEUE_NAME) == 100
    big, kept = ledger.snapshot("big"), ledger.snapshot("kept")
    assert (big.queued, big.pending) == (0, 10_000)
    assert (kept.queued, kept.pending) == (100, 0)


STAMPED_ROWS = 3000


def test_revoking_by_stamped_header_with_the_celery_cli_revokes_the_dataset_in_the_ledger(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, slow_sim: Sim, tmp_path: Path
) -> None:
    stamped, other = unique("stamped"), unique("unstamped")
    config = write_config(
        tmp_path,
        redis_url=fleet_redis_url,
        servers=[slow_sim.url],
        datasets=[
            # more than the fleet runs while the celery command starts (300 samples took about 3 s, as
            # long as the command, and the revoke found nothing left to drop)
            {"name": stamped, "rows": token_rows(STAMPED_ROWS, seed=11)},
            {"name": other, "rows": token_rows(200, seed=12), "max_samples": 30},
        ],
        # one sample per message: many messages wait in the queue for a task thread (each process holds
        # two at most), where a stamped revoke finds them
        top={"samples_per_task": 1},
    )
    run = BackgroundSubmit(config, "--window", "32")
    wait_until(lambda: stamped in fleet_ledger.datasets() and fleet_ledger.snapshot(stamped).samples >= 3)

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "workers.app",
            "control",
            "revoke_by_stamped_headers",
            f"dataset={stamped}",
        ],
        env=dict(os.environ) | {"TOKENFLEET_REDIS_URL": fleet_redis_url},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr

    wait_until(lambda: fleet_ledger.snapshot(stamped).state == "revoked", what="the ledger to say revoked")
    assert run.wait() == 0
    assert fleet_ledger.snapshot(stamped).samples < STAMPED_ROWS
    assert fleet_ledger.snapshot(other).samples == 30


def test_a_task_dropped_by_the_ledger_is_reported_to_flower_as_revoked_with_its_reason(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger
) -> None:
    from workers.app import make_app

    app = make_app(fleet_redis_url)
    name = unique("dropped_events")
    fleet_ledger.register(name, DatasetLimits(), {"servers": ["http://127.0.0.1:1"], "sampling": {}})
    fleet_ledger.pause(name)
    events: list[dict[str, Any]] = []
    with app.connection_for_read() as conn:
        receiver = app.events.Receiver(conn, handlers={"*": events.append})
        listening = threading.Thread(target=lambda: receiver.capture(limit=None, timeout=None), daemon=True)
        listening.start()
        # Events sent before the receiver listens are lost (pub/sub): send our own until one comes back
        with app.events.default_dispatcher() as dispatcher:

            def heard_back() -> bool:
                dispatcher.send("tokenfleet-listening")
                return any(e["type"] == "tokenfleet-listening" for e in events)

            wait_until(heard_back, timeout_s=10, what="the event receiver to listen")
        samples = [Sample(f"s{i}", i + 1, [3, 4], None, {}) for i in range(3)]
        TaskPublisher(app)(name, samples)  # published past the ledger, as a stale producer might
        try:
            wait_until(
                lambda: sum(1 for e in events if e["type"] == "task-revoked") >= 3,
                timeout_s=20,
                what="events",
            )
        finally:
            receiver.should_stop = True
    revoked = [e for e in events if e["type"] == "task-revoked"]
    succeeded = {e["uuid"] for e in events if e["type"] == "task-succeeded"}
    assert all(e.get("reason") == "paused" for e in revoked)
    assert not succeeded & {e["uuid"] for e in revoked}
    received = [e for e in events if e["type"] == "task-received"]
    assert any(f"'dataset': '{name}'" in e.get("kwargs", "") for e in received)
    assert fleet_ledger.snapshot(name).pending == 3
