"""The fleet behind a real ``sglang-router`` (PyPI) in front of two simulators.

The router loads a tokenizer for the model its workers serve; it gets a local folder this test builds
(``tests/support/tokenizer.py``: ``tokenizers``, saved as a PreTrainedTokenizerFast folder), named by
``--tokenizer-path`` and by the simulators' ``/model_info``, so it never tries to download one. The router
does not proxy ``/abort_request`` (``shared/reference/sglang-http.md``): a stopped generation ends when the
worker closes its stream and the router drops the engine request.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from budget import Ledger
from budget.server_board import ServerLedger
from tests.support.env import IN_CI
from tests.support.files import unique, write_config
from tests.support.fleet import Sim, export, submit, token_rows
from tokenfleet.processes import free_port
from workers.rids import dataset_tag

pytestmark = pytest.mark.integration

for _module in ("sglang_router", "tokenizers"):
    try:
        importlib.import_module(_module)
    except ImportError:
        if IN_CI:
            raise
        pytest.skip(f"{_module} is not installed (pip install -e '.[dev]')", allow_module_level=True)

ROUTER_START_S = 30.0


@dataclass
class Router:
    url: str
    log: Path
    sims: list[Sim]

    def generated(self, dataset: str) -> int:
        """Tokens the simulators behind the router generated for ``dataset``'s requests."""
        return sum(int(s.stats()["by_prefix"].get(dataset_tag(dataset), 0)) for s in self.sims)


@pytest.fixture
def router(
    sim_factory: Callable[..., Sim], tokenizer_dir: Path, tmp_path: Path
) -> Iterator[Callable[..., Router]]:
    started: list[subprocess.Popen[bytes]] = []

    def start(**sim_knobs: Any) -> Router:
        # The router loads the tokenizer named by the workers' model: a local path here.
        local = {"model_path": str(tokenizer_dir), "tokenizer_path": str(tokenizer_dir)}
        sims = [sim_factory(**(local | sim_knobs)) for _ in range(2)]
        port = free_port()
        log = tmp_path / f"router-{port}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "sglang_router.launch_router",
                    "--worker-urls",
                    *(s.url for s in sims),
                    "--policy",
                    "round_robin",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--tokenizer-path",
                    str(tokenizer_dir),
                    "--log-level",
                    "info",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        started.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_for_router(url, proc, log)
        return Router(url, log, sims)

    yield start
    for proc in started:
        proc.terminate()
        proc.wait(timeout=10)


def wait_for_router(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Until the router answers and lists both workers as healthy."""
    deadline = time.monotonic() + ROUTER_START_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the router exited: {log.read_text()[-2000:]}"
        try:
            workers = httpx.get(f"{url}/workers", timeout=1).json()["workers"]
            if len(workers) == 2 and all(w["is_healthy"] for w in workers):
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"the router did not come up: {log.read_text()[-2000:]}")


def test_a_full_fleet_run_through_the_router_exports_every_sample_with_the_exact_tokens(
    workers: Any,
    fleet_redis_url: str,
    fleet_ledger: Ledger,
    router: Callable[..., Router],
    tokenizer_dir: Path,
    tmp_path: Path,
) -> None:
    front = router()
    name = unique("routed")
    rows = token_rows(60, seed=21)
    config = write_config(
        tmp_path,
        redis_url=fleet_redis_url,
        servers=[front.url],
        datasets=[{"name": name, "rows": rows}],
        sampling={"max_new_tokens": 64},
    )
    model_info = httpx.get(f"{front.sims[0].url}/model_info", timeout=5).json()

    # The server check works behind the router: it answers /get_server_info (not /server_info) and
    # proxies the one-token probe (one request more on one of the servers).
    assert submit(config) == 0

    snap = fleet_ledger.snapshot(name)
    records = export(fleet_ledger, name, tmp_path)
    requests = [s.stats()["requests"] for s in front.sims]
    assert snap.samples == len(records) == 60 and snap.failed == 0
    assert snap.tokens == sum(r["completion_tokens"] for r in records)
    assert all(r["server"] == front.url for r in records)
    by_prompt = {tuple(r["input_ids"]): r["output_ids"] for r in records}
    for row in rows[:5]:  # what went through the router is exactly what a server generates
        direct = front.sims[1].generate(row["input_ids"], {"max_new_tokens": 64})
        assert by_prompt[tuple(row["input_ids"])] == direct["output_ids"]
    # round robin behind the router: each server did half, and one of them the submit's probe
    assert sorted(requests) == [30, 31]
    # The router loaded the local tokenizer the simulators name, and never reached for the Hub.
    assert model_info["tokenizer_path"] == str(tokenizer_dir)
    log = front.log.read_text(errors="replace")
    assert "Tokenizer loaded" in log and str(tokenizer_dir) in log
    assert "HuggingFace" not in log and "download" not in log.lower()
    # To the fleet the router is one server; it has no /server_info, so no cap.
    status = ServerLedger(fleet_ledger.client).status([front.url])[0]
    assert status.up and status.cap is None and status.started == 60 and status.inflight == 0


def test_the_token_budget_holds_behind_the_router_with_no_abort_needed(
    workers: Any,
    fleet_redis_url: str,
    fleet_ledger: Ledger,
    router: Callable[..., Router],
    tmp_path: Path,
) -> None:
    # Every prompt wants 1000 tokens; max_new_tokens is 2000. The router does not proxy /abort_request,
    # which no longer matters for a budget: each request is sent with max_new_tokens at most its
    # reservation, so the servers behind the router stop at the budget themselves.
    step_s, wanted, budget = 0.002, 1000, 3000
    front = router(step_time_s=step_s, fixed_output_len=wanted)
    name = unique("routed_budget")
    config = write_config(
        tmp_path,
        redis_url=fleet_redis_url,
        servers=[front.url],
        datasets=[{"name": name, "rows": token_rows(64, seed=22), "token_budget": budget}],
        sampling={"max_new_tokens": 2 * wanted},
    )

    assert submit(config, "--no-server-check") == 0

    snap = fleet_ledger.snapshot(name)
    records = export(fleet_ledger, name, tmp_path)
    stats = [s.stats() for s in front.sims]
    generated = front.generated(name)
    print(f"{sum(s['requests'] for s in stats)} streams, {generated} tokens generated for a {budget} budget")
    assert snap.state == "exhausted"
    assert snap.tokens == sum(r["completion_tokens"] for r in records) == generated == budget
    assert snap.wasted_tokens == 0 and snap.reserved_tokens == 0
    # nothing had to be cut from the outside: no stream was closed under a running request
    assert sum(s["disconnected"] for s in stats) == 0
    assert all(s["running"] == 0 and s["waiting"] == 0 for s in stats)
