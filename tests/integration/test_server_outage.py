"""A lone server stopped (nothing listens at its port, as while SGLang restarts and loads its model) for
longer than a task's retries take: real worker processes on a private Redis, the simulator over HTTP."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from budget.keys import dataset_keys
from budget.server_board import ServerLedger
from tests.support.files import unique, write_config
from tests.support.fleet import BackgroundSubmit, PrivateFleet, Sim, export, token_rows, wait_until
from tokenfleet.processes import free_port
from workers.runner import SERVERS_DOWN

pytestmark = pytest.mark.integration

#: A task's retries span about a second here; the server stays down for many times that.
QUICK_RETRY = "\n[retry]\nmax_attempts = 3\nbackoff_base_s = 0.05\nbackoff_cap_s = 0.2\nmin_span_s = 1.0\n"
OUTAGE_S = 8.0
#: How long a generation waits for a dead server before its sample goes back (``TOKENFLEET_SERVER_WAIT_S``).
SERVER_WAIT_S = 2.0


def test_a_lone_server_down_longer_than_the_retries_fails_no_sample_and_gets_no_requests_while_dead(
    private_fleet: Callable[..., PrivateFleet], sim_factory: Callable[..., Sim], tmp_path: Path
) -> None:
    fleet = private_fleet()
    for name in ("outage-a", "outage-b"):
        fleet.start_worker(name, env={"TOKENFLEET_SERVER_WAIT_S": str(SERVER_WAIT_S)})
    ledger, board = fleet.ledger(), ServerLedger.from_url(fleet.url)
    port = free_port()
    knobs = {"step_time_s": 0.01, "output_len_mean": 40.0}
    sim = sim_factory(port=port, **knobs)
    name = unique("lone_outage")
    n = 160
    config = write_config(
        tmp_path, redis_url=fleet.url, servers=[sim.url], datasets=[{"name": name, "rows": token_rows(n)}]
    )
    config.write_text(config.read_text() + QUICK_RETRY)

    run = BackgroundSubmit(config, "--window", "32")
    wait_until(lambda: name in ledger.datasets() and ledger.snapshot(name).samples >= 10, what="10 done")
    sim.server.stop()
    time.sleep(OUTAGE_S / 2)
    started_midway = board.status([sim.url])[0].started
    time.sleep(OUTAGE_S / 2)
    dead = board.status([sim.url])[0]
    snap = ledger.snapshot(name)
    reasons = Counter(ledger.client.hvals(dataset_keys(name).pending_hash))
    print(f"at the end of the outage: {snap}; pending reasons {dict(reasons)}; server {dead}")

    assert run.code is None  # not settled: the samples wait for the server
    assert snap.failed == 0 and not dead.up
    assert reasons[SERVERS_DOWN] > 0  # waited out, given back without a strike
    # Known dead in both worker processes: no generation sent in the outage's second half (probes only)
    assert dead.started - started_midway == 0

    sim_factory(port=port, **knobs)  # the same URL, served again
    assert run.wait(120) == 0
    snap = ledger.snapshot(name)
    records = export(ledger, name, tmp_path)
    assert snap.failed == 0 and snap.samples == len(records) == n
    assert len({r["id"] for r in records}) == n
    assert snap.tokens == sum(r["completion_tokens"] for r in records)
