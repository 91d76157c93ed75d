"""What Flower shows of a run, read from a real Flower process's API while real workers generate on the
simulator: tasks STARTED while their samples generate, a failed sample as a FAILURE task with the server's
message, and its Revoke button stopping that task's generations by rid within a second."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from budget import Ledger
from tests.support.files import unique, write_config
from tests.support.fleet import BackgroundSubmit, Sim, export, submit, submit_process, token_rows, wait_until
from tests.support.flower import Flower, task_sample_ids
from tests.support.ledger import pending
from workers.rids import dataset_tag

pytestmark = pytest.mark.integration

STEP_S = 0.005
#: Every answer of the steady run is this long: 1.5 s of decode steps.
ANSWER_TOKENS = 300
SERVER_BATCH = 16


@pytest.fixture(scope="module")
def flower(fleet_redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Flower]:
    f = Flower(fleet_redis_url, tmp_path_factory.mktemp("flower") / "flower.log")
    yield f
    f.close()


def config_for(tmp_path: Path, redis_url: str, sim: Sim, datasets: list[dict[str, Any]], **top: Any) -> Path:
    config = write_config(
        tmp_path,
        redis_url=redis_url,
        servers=[sim.url],
        datasets=datasets,
        sampling={"max_new_tokens": 4096},
        top=top or None,
    )
    config.write_text(
        config.read_text().replace(
            "timeout_s = 60\n", f"timeout_s = 60\nmax_inflight_per_server = {SERVER_BATCH}\n"
        )
    )
    return config


def started_samples(flower: Flower, dataset: str) -> int:
    return sum(
        len(task_sample_ids(t))
        for t in flower.tasks(state="STARTED", search=f"kwargs:dataset={dataset}").values()
    )


def test_during_a_steady_run_flowers_started_tasks_hold_the_generations_the_server_runs(
    workers: Any,
    flower: Flower,
    fleet_redis_url: str,
    fleet_ledger: Ledger,
    sim_factory: Callable[..., Sim],
    tmp_path: Path,
) -> None:
    sim = sim_factory(step_time_s=STEP_S, fixed_output_len=ANSWER_TOKENS, max_running_requests=SERVER_BATCH)
    name = unique("steady")
    config = config_for(tmp_path, fleet_redis_url, sim, [{"name": name, "rows": token_rows(160, seed=3)}])
    run = BackgroundSubmit(config)
    wait_until(lambda: sim.stats()["running"] >= SERVER_BATCH, what="the server's batch full")

    ratios: list[float] = []
    while len(ratios) < 8 and run.code is None:
        running = sim.stats()["running"]
        started = started_samples(flower, name)
        if running >= SERVER_BATCH // 2:  # the steady part, not the run's last answers
            ratios.append(started / running)
        time.sleep(0.3)
    assert run.wait(120) == 0

    assert len(ratios) >= 5, f"only {len(ratios)} looks at the steady part"
    assert min(ratios) >= 0.8, f"Flower's STARTED tasks held {ratios} of the generations the server ran"
    done = flower.tasks(search=f"kwargs:dataset={name}")
    assert {t["state"] for t in done.values()} == {"SUCCESS"}
    assert sorted(s for t in done.values() for s in task_sample_ids(t)) == sorted(
        fleet_ledger.done_attempts(name)
    )
    # A task's runtime is its generations': every answer takes ANSWER_TOKENS decode steps.
    assert min(t["runtime"] for t in done.values()) >= ANSWER_TOKENS * STEP_S * 0.9
    assert all(
        "'outcome': 'committed'" in t["result"] and "'finish_reason'" in t["result"] for t in done.values()
    )
    # Searching Flower by a sample id finds its task.
    some_task_id, some_task = next(iter(done.items()))
    sample_id = task_sample_ids(some_task)[0]
    assert some_task_id in flower.tasks(search=sample_id)


def test_a_sample_that_fails_for_good_is_a_failure_task_with_the_servers_message(
    workers: Any,
    flower: Flower,
    fleet_redis_url: str,
    fleet_ledger: Ledger,
    sim_factory: Callable[..., Sim],
    tmp_path: Path,
) -> None:
    # The scheduler's prompt limit is below the context length: a longer prompt is answered with 200, then
    # aborted with status 400 inside the stream (never retried).
    sim = sim_factory(context_length=256, max_total_tokens=40)
    limit = sim.server.config.max_req_input_len
    name = unique("failing")
    rows = [{"id": f"ok-{i}", "input_ids": [5 + i] * 10} for i in range(6)]
    rows.append({"id": "too-long-0", "input_ids": [9] * (limit + 5)})
    config = config_for(
        tmp_path, fleet_redis_url, sim, [{"name": name, "rows": rows, "sampling": {"max_new_tokens": 16}}]
    )
    assert submit(config, "--no-server-check") == 0
    reason = fleet_ledger.failures(name)["too-long-0"]
    assert "status 400" in reason

    wait_until(
        lambda: len(flower.tasks(state="FAILURE", search=f"kwargs:dataset={name}")) == 1,
        timeout_s=10,
        what="Flower to show the failed task",
    )
    ((_, failed),) = flower.tasks(state="FAILURE", search=f"kwargs:dataset={name}").items()
    assert "too-long-0" in task_sample_ids(failed)
    assert "SampleFailed" in failed["exception"] and reason in failed["exception"]
    others = flower.tasks(state="SUCCESS", search=f"kwargs:dataset={name}")
    assert sum(len(task_sample_ids(t)) for t in others.values()) + len(task_sample_ids(failed)) == 7


def test_a_revoke_from_flower_stops_that_tasks_generations_within_one_second_and_loses_nothing(
    workers: Any,
    flower: Flower,
    fleet_redis_url: str,
    fleet_ledger: Ledger,
    sim_factory: Callable[..., Sim],
    tmp_path: Path,
) -> None:
    # One task of 4 samples, each 10 s of decode steps.
    sim = sim_factory(step_time_s=STEP_S, fixed_output_len=2000)
    name = unique("revoked_task")
    config = config_for(
        tmp_path, fleet_redis_url, sim, [{"name": name, "rows": token_rows(4, seed=5)}], samples_per_task=4
    )
    producer = submit_process(config)
    try:
        wait_until(lambda: started_samples(flower, name) == 4, what="Flower to show the task STARTED")
        wait_until(lambda: sim.stats()["running"] == 4, what="its 4 generations running")
    finally:  # nobody feeds the revoked samples again until the next submit
        producer.send_signal(signal.SIGKILL)
        producer.wait()
    ((task_id, _),) = flower.tasks(state="STARTED", search=f"kwargs:dataset={name}").items()
    tag = dataset_tag(name)

    def generated() -> int:
        return int(sim.stats()["by_prefix"].get(tag, 0))

    revoked_at = time.monotonic()
    flower.revoke(task_id, terminate=True)
    time.sleep(max(0.0, revoked_at + 1.0 - time.monotonic()))
    at_1s = generated()
    time.sleep(2.0)
    assert generated() == at_1s, f"the server generated {generated() - at_1s} tokens 1 s after the revoke"
    assert at_1s < 4 * 2000, "the generations ended on their own"

    wait_until(lambda: flower.tasks()[task_id]["state"] == "REVOKED", timeout_s=20, what="the task REVOKED")
    snap = fleet_ledger.snapshot(name)
    assert (snap.samples, snap.inflight) == (0, 0)
    assert set(pending(fleet_ledger.client, name).values()) == {"revoked"}
    assert len(pending(fleet_ledger.client, name)) == 4

    # Fed again by the next submit: each sample counted once, the ledger's tokens the export's.
    assert submit(config, "--no-server-check") == 0
    snap = fleet_ledger.snapshot(name)
    rows = export(fleet_ledger, name, tmp_path)
    assert snap.samples == len(rows) == 4
    assert snap.tokens == sum(r["completion_tokens"] for r in rows)
