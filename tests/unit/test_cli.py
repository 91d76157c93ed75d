"""What ``tokenfleet`` answers a user's mistake before it reaches Redis: a limit a config would refuse, a
malformed Redis URL from the option or the environment, each one line and exit 2 with the ledger left
alone; and the warning that an export of a dataset still running holds what is committed so far. The
ledger is a stub: these need no Redis."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, cast

import pytest

from budget import DatasetSnapshot, Ledger
from budget.urls import REDIS_URL_ENV
from tests.support.exports import StubLedger, write_part
from tests.support.snapshots import snapshot_of
from tokenfleet import cli
from tokenfleet.cli import EXIT_OK, EXIT_USAGE, build_parser, main


class LimitsLedger:
    """The ledger ``tokenfleet budget`` talks to: it records each change of limits."""

    def __init__(self) -> None:
        self.changes: list[tuple[str, object, object]] = []

    def set_limits(self, name: str, token_budget: object, max_samples: object) -> str:
        self.changes.append((name, token_budget, max_samples))
        return "active"

    def snapshot(self, name: str) -> DatasetSnapshot:  # a submit feeds it: nothing to warn about
        return snapshot_of(name, fed_s_ago=0.5)


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[LimitsLedger]:
    """The ledgers the command opened (none when it stopped first)."""
    ledgers: list[LimitsLedger] = []

    def open_ledger(args: argparse.Namespace) -> Ledger:
        ledgers.append(LimitsLedger())
        return cast(Ledger, ledgers[-1])

    monkeypatch.setattr(cli, "_ledger", open_ledger)
    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    return ledgers


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-5"], "error: tokens: input should be greater than or equal to 1 (got -5)"),
        (["0"], "error: tokens: input should be greater than or equal to 1 (got 0)"),
        ([str(2**63)], f"error: tokens: input should be less than or equal to {2**63 - 1} (got {2**63})"),
        (["1000", "--max-samples", "-1"], "error: --max-samples: input should be greater than or equal to 1"),
        (["1000", "--max-samples", "0"], "error: --max-samples: input should be greater than or equal to 1"),
        (["10M"], "error: tokens: a whole number of tokens, '-' to leave it as it is, or 'none' to remove"),
        (["-", "--max-samples", "x"], "error: --max-samples: a whole number of samples, '-' to leave it as"),
    ],
    ids=[
        "negative-tokens",
        "zero-tokens",
        "tokens-past-int64",
        "negative-max-samples",
        "zero-max-samples",
        "tokens-not-a-number",
        "max-samples-not-a-number",
    ],
)
def test_budget_refuses_a_limit_the_config_would_refuse_with_exit_2_and_leaves_the_ledger_alone(
    opened: list[LimitsLedger], capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(["budget", "ds", *argv]) == EXIT_USAGE

    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err
    assert opened == []  # refused before the ledger was opened: nothing changed


def test_budget_with_positive_limits_sets_them_and_without_max_samples_leaves_the_cap_unchanged(
    opened: list[LimitsLedger],
) -> None:
    assert main(["budget", "ds", "20000000", "--max-samples", "9000"]) == EXIT_OK
    assert main(["budget", "ds", "1"]) == EXIT_OK

    assert [ledger.changes for ledger in opened] == [[("ds", 20_000_000, 9000)], [("ds", 1, "-")]]


def test_budget_can_change_the_sample_cap_alone_and_remove_either_limit(opened: list[LimitsLedger]) -> None:
    # before: the token budget was a required number, so lowering the cap alone meant restating it
    assert main(["budget", "ds", "-", "--max-samples", "500"]) == EXIT_OK
    assert main(["budget", "ds", "none", "--max-samples", "None"]) == EXIT_OK
    assert main(["budget", "ds", "2_000_000"]) == EXIT_OK

    assert [ledger.changes for ledger in opened] == [
        [("ds", "-", 500)],
        [("ds", None, None)],
        [("ds", 2_000_000, "-")],
    ]


def commands_taking_a_redis_url() -> set[str]:
    """The subcommands whose parser has ``--redis-url``."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name for name, p in sub.choices.items() if "--redis-url" in p._option_string_actions}


#: Each command that takes ``--redis-url``, with the arguments it needs, and the function that runs it.
REDIS_COMMANDS: dict[str, tuple[list[str], str]] = {
    "status": ([], "cmd_status"),
    "export": (["ds", "-o", "ds.jsonl"], "cmd_export"),
    "pause": (["ds"], "cmd_control"),
    "resume": (["ds"], "cmd_control"),
    "revoke": (["ds"], "cmd_control"),
    "budget": (["ds", "1000"], "cmd_budget"),
    "reconcile": ([], "cmd_reconcile"),
    "worker": ([], "cmd_worker"),
    "metrics": ([], "cmd_metrics"),
    "demo": ([], "cmd_demo"),
}


def test_the_commands_checked_here_are_every_command_that_takes_a_redis_url() -> None:
    assert commands_taking_a_redis_url() == set(REDIS_COMMANDS)


@pytest.mark.parametrize("command", sorted(REDIS_COMMANDS))
@pytest.mark.parametrize(
    ("url_from", "message"),
    [
        ("option", 'error: --redis-url: "nope" is not a URL like redis://127.0.0.1:6379/0'),
        ("env", 'error: TOKENFLEET_REDIS_URL: "nope" is not a URL like redis://127.0.0.1:6379/0'),
    ],
    ids=["option", "env"],
)
def test_a_malformed_redis_url_stops_every_command_before_it_runs_with_one_line_naming_where_it_came_from(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
    url_from: str,
    message: str,
) -> None:
    args, func = REDIS_COMMANDS[command]

    def reached(args: argparse.Namespace, console: object) -> int:
        raise AssertionError(f"{command} ran with a malformed Redis URL")

    monkeypatch.setattr(cli, func, reached)
    if url_from == "option":
        monkeypatch.delenv(REDIS_URL_ENV, raising=False)
        args = [*args, "--redis-url", "nope"]
    else:
        monkeypatch.setenv(REDIS_URL_ENV, "nope")

    assert main([command, *args]) == EXIT_USAGE

    assert capsys.readouterr().err == message + "\n"


def test_status_with_a_redis_url_of_another_scheme_names_the_schemes_it_takes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(REDIS_URL_ENV, "http://127.0.0.1:6379")

    assert main(["status"]) == EXIT_USAGE

    assert capsys.readouterr().err == (
        'error: TOKENFLEET_REDIS_URL: unsupported scheme "http" (use redis://, rediss:// or unix://)\n'
    )


class RunningLedger(StubLedger):
    """What export reads from the ledger, with the dataset's counters: ``snapshot``."""

    def __init__(self, spec: dict[str, Any], done: dict[str, str], snapshot: DatasetSnapshot) -> None:
        super().__init__(spec, done)
        self._snapshot = snapshot

    def snapshot(self, name: str) -> DatasetSnapshot:
        return self._snapshot


@pytest.mark.parametrize("settled", [False, True], ids=["running", "settled"])
def test_export_of_a_dataset_still_running_warns_on_stderr_and_exits_0(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, settled: bool
) -> None:
    records = [{"id": str(i), "attempt": "a", "completion_tokens": 5} for i in range(2)]
    write_part(tmp_path / "out" / "ds", records)
    counters: dict[str, Any] = {"samples": 2, "source_total": 2, "source_done": True}
    if not settled:
        counters |= {"queued": 4, "inflight": 1}
    ledger = RunningLedger(
        {"output_dir": str(tmp_path / "out")}, {"0": "a", "1": "a"}, snapshot_of("ds", **counters)
    )
    monkeypatch.setattr(cli, "_ledger", lambda args: ledger)

    assert main(["export", "ds", "-o", str(tmp_path / "f.jsonl")]) == EXIT_OK

    out, err = capsys.readouterr()
    assert "exported 2 records" in out
    if settled:
        assert err == ""
    else:
        assert err == (
            "warning: ds is still running (4 queued, 1 in flight): this export holds the 2 samples "
            "committed so far\n"
        )
