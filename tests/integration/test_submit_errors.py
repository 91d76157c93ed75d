"""A user's mistake costs one clear line and exit code 2, with nothing registered or enqueued."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from budget import Ledger
from tests.support.files import unique, write_config
from tests.support.fleet import Sim
from tokenfleet.cli import EXIT_USAGE, main

pytestmark = pytest.mark.integration

ROWS = [{"id": f"s{i}", "text": f"prompt {i}"} for i in range(5)]


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.err.strip()


def assert_one_clear_line(err: str, *fragments: str) -> None:
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    for fragment in fragments:
        assert fragment in err, err


@pytest.fixture
def base(fleet_redis_url: str, sim: Sim, tmp_path: Path) -> dict[str, Any]:
    return {"redis_url": fleet_redis_url, "servers": [sim.url]}


def test_an_unknown_sampling_key_names_the_file_and_line_and_enqueues_nothing(
    base: dict[str, Any], fleet_ledger: Ledger, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = unique("typo")
    config = write_config(
        tmp_path, **base, datasets=[{"name": name, "rows": ROWS}], sampling={"max_tokens": 64}
    )
    line = next(i for i, t in enumerate(config.read_text().splitlines(), 1) if t.startswith("max_tokens"))

    code, err = run(["submit", str(config)], capsys)

    assert code == EXIT_USAGE
    assert_one_clear_line(err, f"tokenfleet.toml:{line}:", "max_tokens", "max_new_tokens")
    assert name not in fleet_ledger.datasets()


def test_a_missing_source_file_is_named_and_nothing_is_enqueued(
    base: dict[str, Any], fleet_ledger: Ledger, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = unique("missing")
    config = write_config(tmp_path, **base, datasets=[{"name": name, "path": "data/nowhere.jsonl"}])

    code, err = run(["submit", str(config)], capsys)

    assert code == EXIT_USAGE
    assert_one_clear_line(err, "data/nowhere.jsonl", "no such file")
    assert name not in fleet_ledger.datasets()


@pytest.mark.parametrize("bad_name", ["../escape", "a/b", ".."])
def test_a_dataset_name_that_could_escape_the_output_dir_is_refused(
    bad_name: str, base: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path, **base, datasets=[{"name": bad_name, "path": "x.jsonl"}])
    (tmp_path / "x.jsonl").write_text('{"text": "hi"}\n')

    code, err = run(["submit", str(config)], capsys)

    assert code == EXIT_USAGE
    assert_one_clear_line(err, "tokenfleet.toml:", "name")
    assert not (tmp_path / "escape").exists()


def test_an_unreachable_redis_is_one_line_that_never_shows_the_password(
    sim: Sim, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(
        tmp_path,
        redis_url="redis://fleet:s3cret-pass@127.0.0.1:1/0",
        servers=[sim.url],
        datasets=[{"name": unique("noredis"), "rows": ROWS}],
    )

    code, err = run(["submit", str(config)], capsys)

    assert code == EXIT_USAGE
    assert_one_clear_line(err, "Redis is unreachable")
    assert "s3cret" not in err


def test_a_server_without_output_ids_is_refused_at_submit(
    fleet_redis_url: str,
    fleet_ledger: Ledger,
    sim_factory: Callable[..., Sim],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    old_server = sim_factory(omit_output_ids=True)
    name = unique("old_server")
    config = write_config(
        tmp_path, redis_url=fleet_redis_url, servers=[old_server.url], datasets=[{"name": name, "rows": ROWS}]
    )

    code, err = run(["submit", str(config)], capsys)

    assert code == EXIT_USAGE
    assert_one_clear_line(err, "output_ids", old_server.url)
    assert name not in fleet_ledger.datasets()


def test_a_server_that_does_not_answer_is_named_at_submit(
    fleet_redis_url: str, fleet_ledger: Ledger, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = unique("no_server")
    config = write_config(
        tmp_path,
        redis_url=fleet_redis_url,
        servers=["http://127.0.0.1:1"],
        datasets=[{"name": name, "rows": ROWS}],
    )

    code, err = run(["submit", str(config)], capsys)

    assert code == EXIT_USAGE
    assert_one_clear_line(err, "http://127.0.0.1:1", "--no-server-check")
    assert name not in fleet_ledger.datasets()


def test_a_server_without_output_ids_fails_samples_with_a_clear_reason_when_the_check_is_skipped(
    workers: Any,
    fleet_redis_url: str,
    fleet_ledger: Ledger,
    sim_factory: Callable[..., Sim],
    tmp_path: Path,
) -> None:
    old_server = sim_factory(omit_output_ids=True)
    name = unique("old_server_unchecked")
    config = write_config(
        tmp_path, redis_url=fleet_redis_url, servers=[old_server.url], datasets=[{"name": name, "rows": ROWS}]
    )

    assert main(["submit", str(config), "--no-server-check"]) == 0

    failures = fleet_ledger.failures(name)
    assert len(failures) == len(ROWS)
    assert all("output_ids" in reason for reason in failures.values())
    assert old_server.stats()["requests"] == len(ROWS)  # a configuration error is not retried
