"""submit against a storage it cannot write, a ledger that vanished, and a dataset that changed since its
first submit: real Redis servers, real worker processes, the simulator over HTTP."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from budget import Ledger
from budget.storage import EPOCH_MARKER, STORAGE_MARKER, check_same_storage, read_marker
from tests.support.files import read_jsonl, unique, write_config, write_jsonl
from tests.support.fleet import PrivateFleet, Sim, export, submit_process, token_rows, wait_until
from tokenfleet.cli import EXIT_USAGE, main
from tokenfleet.processes import free_port, start_redis

pytestmark = pytest.mark.integration


def part_ids(out: Path, name: str) -> list[str]:
    return [str(r["id"]) for p in sorted((out / name).glob("part-*.jsonl")) for r in read_jsonl(p)]


def assert_complete(ledger: Ledger, name: str, tmp_path: Path, n: int) -> list[dict[str, Any]]:
    snap = ledger.snapshot(name)
    records = export(ledger, name, tmp_path)
    assert snap.settled and snap.samples == len(records) == len({r["id"] for r in records}) == n
    assert snap.tokens == sum(r["completion_tokens"] for r in records)
    return records


def test_a_read_only_output_dir_is_one_line_and_exit_2_with_nothing_registered(
    fleet_redis_url: str, fleet_ledger: Ledger, sim: Sim, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = unique("read_only")
    config = write_config(
        tmp_path,
        redis_url=fleet_redis_url,
        servers=[sim.url],
        datasets=[{"name": name, "rows": token_rows(5)}],
    )
    if os.geteuid() == 0:
        readonly = Path("/sys")  # root writes anywhere but in sysfs
    else:
        readonly = tmp_path / "ro"
        readonly.mkdir()
        readonly.chmod(0o555)
    config.write_text(config.read_text().replace('output_dir = "out"', f'output_dir = "{readonly}"'))

    code = main(["submit", str(config), "--no-server-check"])

    err = capsys.readouterr().err
    assert code == EXIT_USAGE
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"error: {config}: output_dir is not writable: cannot write in {readonly}")
    assert name not in fleet_ledger.datasets()


def test_redis_restarted_without_persistence_mid_run_then_submit_again_generates_no_sample_twice(
    private_fleet: Callable[..., PrivateFleet],
    sim_factory: Callable[..., Sim],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fleet = private_fleet()  # --save "" --appendonly no: a restart loses everything
    fleet.start_worker("w1")
    fleet.start_worker("w2")
    sim = sim_factory(step_time_s=0.01, output_len_mean=40.0)
    name = unique("vanished")
    n = 200
    config = write_config(
        tmp_path, redis_url=fleet.url, servers=[sim.url], datasets=[{"name": name, "rows": token_rows(n)}]
    )
    out = tmp_path / "out"
    ledger = fleet.ledger()
    first = submit_process(config, "--window", "32")
    wait_until(lambda: name in ledger.datasets() and ledger.snapshot(name).samples >= 60)

    fleet.restart_redis(down_s=1.0)  # the ledger and the broker's queue are gone

    assert first.wait(timeout=180) == 0  # submit rebuilt the ledger from the outputs and went on
    assert_complete(fleet.ledger(), name, tmp_path, n)
    token = fleet.ledger().spec(name)["storage_token"]
    assert check_same_storage(out, token) is None and read_marker(out / STORAGE_MARKER) == token
    assert read_marker(out / name / EPOCH_MARKER) == fleet.ledger().identity(name)["epoch"]

    fleet.restart_redis(down_s=0.5)  # lost again, now between two submits
    requests = sim.stats()["requests"]
    capsys.readouterr()
    assert main(["submit", str(config), "--no-server-check"]) == 0

    said = capsys.readouterr().out
    assert "appendonly no" in said and "a restart loses the ledger" in said
    assert "the ledger had lost this dataset" in said and f"{n} samples" in said
    assert sim.stats()["requests"] == requests  # nothing generated again
    assert_complete(fleet.ledger(), name, tmp_path / "again", n)
    ids = part_ids(out, name)
    assert len(ids) == len(set(ids)) == n  # no sample on disk was generated again
    # What the loss costs: the generations in flight when the ledger vanished lost their leases with it
    # and are thrown away unwritten (at most the fleet's concurrency: 2 workers x 8 threads).
    stats = sim.stats()
    assert n <= stats["finished"] <= n + 2 * 8
    wasted = stats["generated_tokens"] - fleet.ledger().snapshot(name).tokens
    print(
        f"finished {stats['finished']} for {n} samples, requests {stats['requests']}, wasted tokens {wasted}"
    )


def test_a_redis_that_forbids_config_is_tolerated(tmp_path: Path) -> None:
    port = free_port()
    proc = start_redis(tmp_path / "redis", port, ("--save", "", "--rename-command", "CONFIG", ""))
    try:
        assert Ledger.from_url(f"redis://127.0.0.1:{port}/0").persistence() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)


def _changed_source(config: Path, name: str, n: int, lines: tuple[int, ...], max_new_tokens: int) -> None:
    rows = token_rows(n)
    for line in lines:
        rows[line - 1] = {"input_ids": [7, 7, 7, line]}
    write_jsonl(config.parent / "data" / f"{name}.jsonl", rows)
    text = config.read_text().replace("max_new_tokens = 256", f"max_new_tokens = {max_new_tokens}")
    config.write_text(text)


@pytest.fixture
def settled_dataset(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, sim: Sim, tmp_path: Path
) -> tuple[str, Path]:
    name = unique("changed")
    config = write_config(
        tmp_path,
        redis_url=fleet_redis_url,
        servers=[sim.url],
        datasets=[{"name": name, "rows": token_rows(20)}],
    )
    assert main(["submit", str(config), "--no-server-check"]) == 0
    _changed_source(config, name, 20, (5, 12), 128)
    return name, config


def test_a_changed_config_and_source_are_refused_naming_what_changed(
    settled_dataset: tuple[str, Path], fleet_ledger: Ledger, sim: Sim, capsys: pytest.CaptureFixture[str]
) -> None:
    name, config = settled_dataset
    requests, before = sim.stats()["requests"], fleet_ledger.snapshot(name)
    capsys.readouterr()

    assert main(["submit", str(config), "--no-server-check"]) == EXIT_USAGE

    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f'dataset "{name}" changed since its first submit: sampling.max_new_tokens: 256 -> 128;' in err
    assert "2 line(s) changed or removed, 2 added (first at line 5)" in err
    assert "--accept-change" in err and f"--new-version to generate it afresh as {name}.v2" in err
    assert sim.stats()["requests"] == requests
    assert fleet_ledger.snapshot(name).samples == before.samples == 20
    assert (
        orjson.loads(fleet_ledger.client.get(fleet_ledger.keys_of(name).spec_str))["sampling"][
            "max_new_tokens"
        ]
        == 256
    )


def test_accept_change_goes_on_and_records_the_new_fingerprint(
    settled_dataset: tuple[str, Path], fleet_ledger: Ledger, sim: Sim, capsys: pytest.CaptureFixture[str]
) -> None:
    name, config = settled_dataset
    requests = sim.stats()["requests"]

    assert main(["submit", str(config), "--no-server-check", "--accept-change"]) == 0

    assert "going on as told (--accept-change)" in capsys.readouterr().out
    snap = fleet_ledger.snapshot(name)
    assert snap.samples == 22 and snap.settled  # the two edited lines are new samples (their ids changed)
    assert fleet_ledger.spec(name)["sampling"]["max_new_tokens"] == 128
    assert sim.stats()["requests"] == requests + 2
    assert main(["submit", str(config), "--no-server-check"]) == 0  # the change is the new normal
    assert sim.stats()["requests"] == requests + 2


def test_new_version_generates_the_changed_dataset_apart_and_later_submits_feed_that_version(
    settled_dataset: tuple[str, Path], fleet_ledger: Ledger, sim: Sim, tmp_path: Path
) -> None:
    name, config = settled_dataset
    v2 = f"{name}.v2"

    assert main(["submit", str(config), "--no-server-check", "--new-version"]) == 0

    assert fleet_ledger.snapshot(name).samples == 20  # the first version is untouched
    assert fleet_ledger.spec(name)["sampling"]["max_new_tokens"] == 256
    assert fleet_ledger.spec(v2)["sampling"]["max_new_tokens"] == 128
    records = assert_complete(fleet_ledger, v2, tmp_path, 20)
    assert {r["dataset"] for r in records} == {v2}
    assert len(part_ids(tmp_path / "out", v2)) == 20 and len(part_ids(tmp_path / "out", name)) == 20
    assert fleet_ledger.identity(v2)["version_of"] == name and fleet_ledger.identity(name)["current"] == v2
    requests = sim.stats()["requests"]
    assert main(["submit", str(config), "--no-server-check"]) == 0  # fed as the current version
    assert sim.stats()["requests"] == requests
    assert f"{name}.v3" not in fleet_ledger.datasets()
