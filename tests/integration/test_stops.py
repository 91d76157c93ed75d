"""Stopping a dataset stops all of its requests by their own rids, within a second, in every worker
process, including requests still waiting in a server's queue. And what else the real server taught us,
end to end: API keys, errors carried inside a 200 stream, out-of-vocabulary ids.

The simulator behaves as a real SGLang 0.5.23 server here: ``/abort_request`` aborts only an exact, live
rid, and a request waiting in its queue is prefilled and started unless aborted.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from budget import Ledger
from budget.server_board import ServerLedger
from tests.support.files import read_jsonl, unique, write_config
from tests.support.fleet import BackgroundSubmit, Sim, export, token_rows, wait_until
from tokenfleet.cli import main
from workers.rids import dataset_tag

pytestmark = pytest.mark.integration

#: The simulator runs this many requests at once; the fleet sends more, so the rest wait in its queue.
SERVER_BATCH = 4
FLEET_CAP = 16


#: Requests of a stopped dataset the server may still take from its queue into its batch: the aborts go
#: out at once, so a running request's abort may land before a waiting one's and free its slot for it (one
#: per running request), and a request that ends on its own as the stop lands frees one more (a CI run on
#: 2026-12-05 counted 5). Without the aborts by rid every request waiting in the queue
#: (FLEET_CAP - SERVER_BATCH = 12) is started; measured 10-12.
LATE_STARTS = SERVER_BATCH + 1


def generated_for(sim: Sim, dataset: str) -> int:
    return int(sim.stats()["by_prefix"].get(dataset_tag(dataset), 0))


def started_for(sim: Sim, dataset: str) -> int:
    """Requests of ``dataset`` the server took from its queue into its running batch (prefilled)."""
    return int(sim.stats()["started_by_prefix"].get(dataset_tag(dataset), 0))


@pytest.fixture
def queueing_sim(sim_factory: Callable[..., Sim]) -> Sim:
    # Long generations (about 2 s each) and a small batch: most of the fleet's requests wait.
    return sim_factory(
        step_time_s=0.005, output_len_mean=400.0, output_len_sigma=0.2, max_running_requests=SERVER_BATCH
    )


def queueing_config(tmp_path: Path, redis_url: str, sim: Sim, datasets: list[dict[str, Any]]) -> Path:
    config = write_config(
        tmp_path,
        redis_url=redis_url,
        servers=[sim.url],
        datasets=datasets,
        sampling={"max_new_tokens": 1024},
    )
    text = config.read_text().replace(
        "timeout_s = 60\n", f"timeout_s = 60\nmax_inflight_per_server = {FLEET_CAP}\n"
    )
    config.write_text(text)
    return config


def quiet_after(sim: Sim, dataset: str, command_at: float) -> tuple[int, int]:
    """Tokens the server generated for ``dataset`` 1 s after ``command_at``, and 3 s later."""
    time.sleep(max(0.0, command_at + 1.0 - time.monotonic()))
    at_1s = generated_for(sim, dataset)
    time.sleep(3.0)
    return at_1s, generated_for(sim, dataset)


def test_a_revoke_aborts_running_and_queued_requests_within_one_second_and_the_other_dataset_completes(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, queueing_sim: Sim, tmp_path: Path
) -> None:
    revoked, other = unique("revoked"), unique("other")
    config = queueing_config(
        tmp_path,
        fleet_redis_url,
        queueing_sim,
        [{"name": revoked, "rows": token_rows(200, seed=8)}, {"name": other, "rows": token_rows(12, seed=9)}],
    )
    run = BackgroundSubmit(config, "--window", "32")
    wait_until(lambda: revoked in fleet_ledger.datasets(), what="the dataset registered")
    wait_until(
        lambda: queueing_sim.stats()["waiting"] >= FLEET_CAP - SERVER_BATCH - 2,
        what="requests waiting in the server's queue",
    )

    started = started_for(queueing_sim, revoked)
    revoked_at = time.monotonic()
    assert main(["revoke", revoked, "--redis-url", fleet_redis_url]) == 0
    at_1s, later = quiet_after(queueing_sim, revoked, revoked_at)

    assert later == at_1s, f"the server generated {later - at_1s} tokens for a dataset revoked 1 s before"
    late = started_for(queueing_sim, revoked) - started
    assert late <= LATE_STARTS, f"{late} requests waiting in the server's queue were started after the revoke"
    assert run.wait(120) == 0
    assert fleet_ledger.snapshot(revoked).state == "revoked"
    assert fleet_ledger.snapshot(other).samples == 12
    assert generated_for(queueing_sim, revoked) == later


def test_a_pause_stops_what_runs_within_one_second_and_resume_loses_nothing(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, queueing_sim: Sim, tmp_path: Path
) -> None:
    name = unique("paused")
    config = queueing_config(
        tmp_path, fleet_redis_url, queueing_sim, [{"name": name, "rows": token_rows(20)}]
    )
    run = BackgroundSubmit(config, "--window", "32")
    wait_until(lambda: name in fleet_ledger.datasets(), what="the dataset registered")
    wait_until(
        lambda: queueing_sim.stats()["waiting"] >= FLEET_CAP - SERVER_BATCH - 2,
        what="requests waiting in the server's queue",
    )

    started = started_for(queueing_sim, name)
    paused_at = time.monotonic()
    assert main(["pause", name, "--redis-url", fleet_redis_url]) == 0
    at_1s, later = quiet_after(queueing_sim, name, paused_at)
    assert later == at_1s, f"the server generated {later - at_1s} tokens for a dataset paused 1 s before"
    late = started_for(queueing_sim, name) - started
    assert late <= LATE_STARTS, f"{late} requests waiting in the server's queue were started after the pause"
    assert fleet_ledger.snapshot(name).inflight == 0

    assert main(["resume", name, "--redis-url", fleet_redis_url]) == 0
    assert run.wait(180) == 0
    snap = fleet_ledger.snapshot(name)
    records = export(fleet_ledger, name, tmp_path)
    assert snap.samples == len(records) == 20 and snap.failed == 0
    assert len({r["id"] for r in records}) == 20
    assert snap.tokens == sum(r["completion_tokens"] for r in records)


def test_a_lowered_budget_stops_in_flight_generations_within_one_second(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, queueing_sim: Sim, tmp_path: Path
) -> None:
    name = unique("rebudget")
    config = queueing_config(
        tmp_path,
        fleet_redis_url,
        queueing_sim,
        [{"name": name, "rows": token_rows(100), "token_budget": 1_000_000, "on_budget": "truncate"}],
    )
    run = BackgroundSubmit(config, "--window", "32")
    wait_until(lambda: name in fleet_ledger.datasets(), what="the dataset registered")
    wait_until(lambda: generated_for(queueing_sim, name) >= 500, what="some tokens generated")
    wait_until(
        lambda: queueing_sim.stats()["waiting"] >= FLEET_CAP - SERVER_BATCH - 2,
        what="requests waiting in the server's queue",
    )

    started = started_for(queueing_sim, name)
    lowered_at = time.monotonic()
    assert main(["budget", name, "100", "--redis-url", fleet_redis_url]) == 0
    at_1s, later = quiet_after(queueing_sim, name, lowered_at)
    assert later == at_1s, f"{later - at_1s} tokens generated 1 s after the budget was lowered"
    late = started_for(queueing_sim, name) - started
    assert late <= LATE_STARTS, f"{late} waiting requests were started after the budget was lowered"
    assert run.wait(120) == 0
    snap = fleet_ledger.snapshot(name)
    records = export(fleet_ledger, name, tmp_path)
    assert snap.state == "exhausted" and snap.tokens == sum(r["completion_tokens"] for r in records)
    assert any(r["truncated"] for r in records), "the generations in flight were kept, cut at the stop"


def test_a_server_with_api_keys_is_used_end_to_end_and_the_keys_show_nowhere(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, sim_factory: Callable[..., Sim], tmp_path: Path
) -> None:
    api_key, admin_key = "sk-tf-test-3141592653", "adm-tf-test-2718281828"
    sim = sim_factory(api_key=api_key, admin_api_key=admin_key, step_time_s=0.005, output_len_mean=200.0)
    (tmp_path / "api.key").write_text(api_key + "\n")
    (tmp_path / "admin.key").write_text(admin_key + "\n")
    name, revoked = unique("keyed"), unique("keyed_revoked")
    config = write_config(
        tmp_path,
        redis_url=fleet_redis_url,
        servers=[sim.url],
        datasets=[{"name": name, "rows": token_rows(30)}, {"name": revoked, "rows": token_rows(300, seed=4)}],
        sampling={"max_new_tokens": 512},
    )
    keys = f'api_key_file = "{tmp_path / "api.key"}"\nadmin_api_key_file = "{tmp_path / "admin.key"}"\n'
    config.write_text(config.read_text().replace("timeout_s = 60\n", "timeout_s = 60\n" + keys))

    run = BackgroundSubmit(config, "--window", "32")
    wait_until(lambda: revoked in fleet_ledger.datasets(), what="the datasets registered")
    wait_until(lambda: generated_for(sim, revoked) >= 1000, what="the second dataset generating")
    revoked_at = time.monotonic()
    assert main(["revoke", revoked, "--redis-url", fleet_redis_url]) == 0
    at_1s, later = quiet_after(sim, revoked, revoked_at)
    assert later == at_1s, "the aborts (admin key) did not stop the revoked dataset"
    assert run.wait(120) == 0

    records = export(fleet_ledger, name, tmp_path)
    assert len(records) == 30 and all(r["output_ids"] for r in records)
    everything = [json.dumps(records)]
    for part in (tmp_path / "out").rglob("*.jsonl"):
        everything.append(part.read_text())
    for key in fleet_ledger.client.scan_iter("*"):
        kind = fleet_ledger.client.type(key)
        if kind == "string":
            everything.append(str(fleet_ledger.client.get(key)))
        elif kind == "hash":
            everything.append(json.dumps(fleet_ledger.client.hgetall(key)))
    status = _run_status(fleet_redis_url, name, revoked)
    everything.append(status)
    assert name in status
    for text in everything:
        assert api_key not in text and admin_key not in text


def _run_status(redis_url: str, *names: str) -> str:
    """``tokenfleet status`` as an operator runs it, plain and --json."""
    out = ""
    for extra in ([], ["--json"]):
        done = subprocess.run(
            [sys.executable, "-m", "tokenfleet.cli", "status", *names, *extra, "--redis-url", redis_url],
            capture_output=True,
            text=True,
            timeout=60,
        )
        out += done.stdout + done.stderr
    return out


def test_an_input_error_inside_a_200_stream_fails_that_sample_only_and_the_server_stays_up(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, sim_factory: Callable[..., Sim], tmp_path: Path
) -> None:
    # The scheduler's prompt limit (max_req_input_len) is below the context length: a longer prompt is
    # accepted with 200, queued, then aborted with status 400.
    sim = sim_factory(context_length=256, max_total_tokens=40)
    limit = sim.server.config.max_req_input_len
    name = unique("in_stream")
    rows = [{"id": f"ok-{i}", "input_ids": [5 + i] * 10} for i in range(8)]
    rows.append({"id": "too-long-0", "input_ids": [9] * (limit + 5)})
    config = write_config(
        tmp_path,
        redis_url=fleet_redis_url,
        servers=[sim.url],
        datasets=[{"name": name, "rows": rows}],
        sampling={"max_new_tokens": 16},
    )
    assert main(["submit", str(config), "--no-server-check"]) == 0

    snap = fleet_ledger.snapshot(name)
    failures = fleet_ledger.failures(name)
    assert snap.samples == 8 and snap.failed == 1
    assert set(failures) == {"too-long-0"} and "status 400" in failures["too-long-0"]
    assert sim.stats()["requests"] == 9, "the 400 was retried"
    (server,) = [s for s in ServerLedger(fleet_ledger.client).status() if s.url == sim.url]
    assert server.up and server.fails_in_a_row == 0 and server.failures == 0
    failed_lines = [f for p in (tmp_path / "out" / name).glob("failed-*.jsonl") for f in read_jsonl(p)]
    assert [f["id"] for f in failed_lines] == ["too-long-0"]


def test_an_out_of_vocabulary_id_is_rejected_at_submit_and_never_reaches_the_server(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, sim_factory: Callable[..., Sim], tmp_path: Path
) -> None:
    sim = sim_factory(vocab_size=1000)  # the simulator crashes on such an id, as the real server does
    name = unique("oov")
    rows = [{"id": f"ok-{i}", "input_ids": [5, 6, 7 + i]} for i in range(5)]
    rows.insert(2, {"id": "oov", "input_ids": [5, 1000, 6]})
    config = write_config(
        tmp_path, redis_url=fleet_redis_url, servers=[sim.url], datasets=[{"name": name, "rows": rows}]
    )
    assert main(["submit", str(config)]) == 0

    (rejected,) = read_jsonl(tmp_path / "out" / name / "rejected.jsonl")
    assert rejected["line"] == 3 and "outside the model's vocabulary (ids 0 to 999)" in rejected["reason"]
    assert fleet_ledger.snapshot(name).samples == 5
    assert not sim.server.crashed
    assert sim.stats()["requests"] == 1 + 5  # the submit's one-token probe, then the good lines


def test_a_lowered_sample_cap_stops_in_flight_generations_within_one_second_and_loses_none(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, queueing_sim: Sim, tmp_path: Path
) -> None:
    # Before: the generations running when the cap was lowered below them ran to their end (about 2 s
    # each here), then were thrown away at commit, and their samples were in no category.
    name = unique("recap")
    big = 10**9
    config = queueing_config(
        tmp_path,
        fleet_redis_url,
        queueing_sim,
        [{"name": name, "rows": token_rows(60), "token_budget": big, "on_budget": "truncate"}],
    )
    run = BackgroundSubmit(config, "--window", "32")
    wait_until(lambda: name in fleet_ledger.datasets(), what="the dataset registered")
    wait_until(lambda: fleet_ledger.snapshot(name).samples >= 2, what="two samples committed")
    wait_until(
        lambda: queueing_sim.stats()["waiting"] >= FLEET_CAP - SERVER_BATCH - 2,
        what="requests waiting in the server's queue",
    )

    cap = fleet_ledger.snapshot(name).samples
    started = started_for(queueing_sim, name)
    lowered_at = time.monotonic()
    assert main(["budget", name, str(big), "--max-samples", str(cap), "--redis-url", fleet_redis_url]) == 0
    at_1s, later = quiet_after(queueing_sim, name, lowered_at)
    assert later == at_1s, f"{later - at_1s} tokens generated 1 s after the sample cap was lowered"
    late = started_for(queueing_sim, name) - started
    assert late <= LATE_STARTS, f"{late} waiting requests were started after the sample cap was lowered"
    assert run.wait(120) == 0

    snap = fleet_ledger.snapshot(name)
    records = export(fleet_ledger, name, tmp_path)
    # a commit that landed between the look and the lowering is kept: the cap is what was committed then
    assert snap.state == "exhausted" and snap.samples == len(records) <= cap + 1
    assert snap.inflight == 0 and snap.failed == 0
    # every other sample is pending (dropped by the cap while it holds), none in no category
    assert snap.samples + snap.pending == 60, (snap.samples, snap.pending)
    reasons = fleet_ledger.pending_reasons(name)
    assert reasons.get("max_samples", 0) >= 1, reasons
