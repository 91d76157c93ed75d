"""A server that stops sending (a wedged engine whose /health still answers 200) costs at most the stall
timeout: its streams are given up and retried on another server, it is marked down at once, and it gets
work again only after a real generation succeeds there."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from budget import Ledger
from budget.server_board import ServerLedger, ServerStatus
from tests.support.files import unique, write_config
from tests.support.fleet import BackgroundSubmit, Sim, export, text_rows, wait_until
from workers.rids import dataset_tag

pytestmark = pytest.mark.integration

STALL_S = 2.0
#: The request timeout of the test's config (write_config): recovery must not wait for it.
REQUEST_TIMEOUT_S = 60.0


def server(ledger: Ledger, url: str) -> ServerStatus:
    (status,) = [s for s in ServerLedger(ledger.client).status() if s.url == url]
    return status


def test_a_wedged_server_is_given_up_after_the_stall_timeout_and_the_other_server_finishes_the_job(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, sim_factory: Callable[..., Sim], tmp_path: Any
) -> None:
    wedging, healthy = (sim_factory(step_time_s=0.005, output_len_mean=80.0) for _ in range(2))
    name = unique("stall")
    config = write_config(
        tmp_path,
        redis_url=fleet_redis_url,
        servers=[wedging.url, healthy.url],
        datasets=[{"name": name, "rows": text_rows(200)}],
        sampling={"max_new_tokens": 200},
    )
    config.write_text(
        config.read_text().replace("timeout_s = 60\n", f"timeout_s = 60\nstall_timeout_s = {STALL_S}\n")
    )
    run = BackgroundSubmit(config, "--window", "32")
    wait_until(lambda: name in fleet_ledger.datasets(), what="the dataset registered")
    wait_until(lambda: fleet_ledger.snapshot(name).samples >= 20, what="the first samples")
    assert wedging.stats()["running"] > 0

    wedging.configure(wedged=True)
    wedged_at = time.monotonic()
    wait_until(
        lambda: not server(fleet_ledger, wedging.url).up, timeout_s=STALL_S + 10, what="the server down"
    )
    assert "stalled" in server(fleet_ledger, wedging.url).last_error
    # Its slots are given back as its streams pass the stall timeout, not after the request timeout.
    wait_until(lambda: server(fleet_ledger, wedging.url).inflight == 0, timeout_s=STALL_S + 5, what="no slot")
    assert time.monotonic() - wedged_at < STALL_S + 5

    def requests_of(prefix: str) -> tuple[int, int]:
        stats = wedging.stats()
        return stats["requests"], stats["requests_by_prefix"].get(dataset_tag(prefix), 0)

    (all_before, ours_before), (_, probes_before) = requests_of(name), requests_of("tokenfleet-probe")
    assert run.wait(90) == 0
    assert time.monotonic() - wedged_at < REQUEST_TIMEOUT_S, "recovery waited for the request timeout"
    # No new work while it is suspect: only the probes (a one-token generation each) reached it. (How many
    # depends on how long the rest of the run takes; each waits out its timeout on a wedged server.)
    (all_after, ours_after), (_, probes_after) = requests_of(name), requests_of("tokenfleet-probe")
    assert ours_after == ours_before
    assert all_after - all_before == probes_after - probes_before
    assert not server(fleet_ledger, wedging.url).up
    snap = fleet_ledger.snapshot(name)
    records = export(fleet_ledger, name, tmp_path)
    assert snap.samples == len(records) == 200 and snap.failed == 0
    assert len({r["id"] for r in records}) == 200
    assert snap.tokens == sum(r["completion_tokens"] for r in records)

    wedging.configure(wedged=False)  # the engine comes back: a probe generation succeeds, it is up again
    wait_until(lambda: server(fleet_ledger, wedging.url).up, timeout_s=45, what="the server up again")


def test_a_server_that_slows_down_past_its_streams_intervals_is_paced_again_and_finishes_the_job(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, sim_factory: Callable[..., Sim], tmp_path: Any
) -> None:
    """Streams paced for a fast server (a chunk at the first token, one at the end) outlast the stall
    timeout once it slows 15x. The stalls drop the pacer's speed to what they saw, so the retries ask for
    short intervals and the job finishes with nothing failed. (A pacer that learned only from answers
    paced every retry for the old speed, and the samples failed.) All streams went silent at once, as on
    a wedged server, so the server may be marked down once; its probe brings it back."""
    stall_s = 2.0
    sim = sim_factory(step_time_s=0.001, fixed_output_len=200)
    warm, slow = unique("fast"), unique("slowdown")
    n = 32
    for name in (warm, slow):
        config = write_config(
            tmp_path / name,
            redis_url=fleet_redis_url,
            servers=[sim.url],
            datasets=[{"name": name, "rows": text_rows(n)}],
            sampling={"max_new_tokens": 200},
        )
        config.write_text(
            config.read_text().replace("timeout_s = 60\n", f"timeout_s = 60\nstall_timeout_s = {stall_s}\n")
        )
        if name == slow:
            # The workers measured 200 tokens in about 0.3 s (over 400 tokens/s, so a chunk every
            # stall_s / 4 is more than 200 tokens: paced at max_new_tokens). Now they take 3 s, past the
            # stall timeout; 64 (the shortest interval) take 1 s.
            sim.configure(step_time_s=0.015)
        assert BackgroundSubmit(config, "--window", "16").wait(120) == 0

    snap = fleet_ledger.snapshot(slow)
    assert snap.samples == n and snap.failed == 0
    assert len(export(fleet_ledger, slow, tmp_path)) == n
    assert sim.stats()["requests"] > 2 * n, "no stream outlasted the stall timeout: the test proved nothing"
    assert server(fleet_ledger, sim.url).downs <= 1
