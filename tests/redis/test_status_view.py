"""``tokenfleet status`` as a person reads it, at 80, 120 and 200 columns: the issue's datasets, settled, in a
real ledger, rendered by a rich Console of that width. Every dataset name and every figure (tokens,
budget, samples, cap) must appear whole, no line may be wider than the terminal, nothing is cut with an
ellipsis; a settled dataset shows ``done`` and no rate; ``status NAME`` shows one dataset in full, and an
unknown NAME is a plain error that lists the known ones."""

from __future__ import annotations

import re
import time
from pathlib import Path

import orjson
import pytest
from rich.cells import cell_len

from budget import DatasetLimits, Ledger
from tests.support.ledger import SPEC, lease
from tests.support.status import LONG_NAME, commit_many, issue_datasets, render, shows
from tokenfleet.cli import EXIT_USAGE, main
from tokenfleet.status_detail import dataset_detail, last_failures
from tokenfleet.status_view import fleet_view, status_table

pytestmark = pytest.mark.redis

WIDTHS = (80, 120, 200)
WORKERS = [{"name": "w0-3f9a1c@gpu-node-17", "version": "v1", "inflight": 0, "concurrency": 32, "age_s": 1.2}]


def assert_fits(text: str, width: int) -> None:
    lines = text.splitlines()
    too_wide = [line for line in lines if cell_len(line) > width]
    assert too_wide == [], f"lines wider than {width} columns: {too_wide}"
    assert "…" not in text and "..." not in text, text


@pytest.mark.parametrize("width", WIDTHS)
def test_every_dataset_name_and_figure_appears_whole_and_no_line_is_wider_than_the_terminal(
    ledger: Ledger, width: int
) -> None:
    expected = issue_datasets(ledger)
    snaps = [ledger.snapshot(n) for n in ledger.datasets()]

    text = render(fleet_view(snaps, WORKERS, "v1"), width)

    assert_fits(text, width)
    for shown in expected:
        assert shows(text, shown.name), f"{shown.name} not whole at {width} columns:\n{text}"
        for figure in shown.figures:
            assert shows(text, figure), f"{shown.name}: {figure!r} not whole at {width} columns:\n{text}"
    assert shows(text, "w0-3f9a1c@gpu-node-17")


def test_at_80_columns_a_40_character_name_stands_on_a_line_of_its_own_above_its_figures(
    ledger: Ledger,
) -> None:
    issue_datasets(ledger)
    text = render(status_table([ledger.snapshot(n) for n in ledger.datasets()]), 80)

    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if LONG_NAME in line)
    assert lines[at].strip() == LONG_NAME
    assert shows(lines[at + 1], "14,808 / 5M") and shows(lines[at + 1], "active")
    # the short names share their line with their figures
    b1 = next(line for line in lines if "B1_sharegpt" in line)
    assert shows(b1, "20,467 / 20,000")


def test_at_120_columns_the_40_character_name_keeps_its_row_and_what_does_not_fit_goes_under_it(
    ledger: Ledger,
) -> None:
    # Its problems (1 failed, 3 rejected) leave no room for every column even with the name on a line
    # of its own: the name stays in its row, and problems go to the line under it.
    issue_datasets(ledger)
    text = render(status_table([ledger.snapshot(n) for n in ledger.datasets()]), 120)

    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if LONG_NAME in line)
    assert shows(lines[at], "14,808 / 5M")
    # its ETA (minutes and seconds; the figure follows the rate over the wall time the test took)
    assert re.search(r"(?<!\S)\d+m\d\ds(?!\S)", lines[at]), lines[at]
    assert lines[at + 1].split() == ["problems", "1", "failed,", "3", "rejected"]


def test_at_200_columns_the_long_name_sits_in_its_row_with_bars_and_the_extra_columns(
    ledger: Ledger,
) -> None:
    issue_datasets(ledger)
    text = render(status_table([ledger.snapshot(n) for n in ledger.datasets()]), 200)

    row = next(line for line in text.splitlines() if LONG_NAME in line)
    assert shows(row, "14,808 / 5M") and "─" * 10 in row  # its bar, empty at 0%
    assert shows(row, "1 failed, 3 rejected")
    header = text.splitlines()[0]
    for column in ("queued", "req/s", "dropped", "overshoot"):
        assert shows(header, column), header


def test_a_settled_dataset_shows_done_and_no_rate_where_it_showed_0s_and_its_last_minutes_rate(
    ledger: Ledger,
) -> None:
    issue_datasets(ledger)
    b1 = ledger.snapshot("B1_sharegpt")
    assert b1.settled and b1.tokens_per_s > 0  # the ledger still has a rate from its last 30 s

    for width in WIDTHS:
        text = render(status_table([b1]), width)
        row = " ".join(next(line for line in text.splitlines() if "B1_sharegpt" in line).split())
        # samples, then tok/s and ETA: no rate, and done
        assert shows(row, "97 — done"), text
        assert not shows(text, "0s"), text


def test_a_terminal_too_narrow_for_the_columns_gets_one_line_per_figure_none_cut(ledger: Ledger) -> None:
    expected = issue_datasets(ledger)
    text = render(status_table([ledger.snapshot(n) for n in ledger.datasets()]), 44)

    assert_fits(text, 44)
    for shown in expected:
        assert shows(text, shown.name)
        for figure in shown.figures:
            assert shows(text, figure), f"{figure!r} not whole:\n{text}"
    assert shows(text, "tokens / budget: 10.7M / 10M 107%"), text


@pytest.mark.parametrize("width", (80, 120))
def test_the_detail_view_shows_limits_policy_outcomes_failures_by_reason_and_the_last_errors(
    ledger: Ledger, tmp_path: Path, width: int
) -> None:
    ledger.register("B5", DatasetLimits(token_budget=10_000_000, max_samples=7000), SPEC)
    commit_many(ledger, "B5", "s", [50_000] * 20)
    for sid, reason in (("f1", "prompt too long: 40,000 tokens"), ("f2", "prompt too long: 40,000 tokens")):
        lease(ledger, sid, f"{sid}-a", name="B5")
        ledger.fail("B5", sid, f"{sid}-a", reason)
    lease(ledger, "f3", "f3-a", name="B5")
    ledger.fail("B5", "f3", "f3-a", "retries ran out: 503 Service Unavailable")
    folder = tmp_path / "B5"
    folder.mkdir()
    now = time.time()
    (folder / "failed-host-1.jsonl").write_bytes(
        b"".join(
            orjson.dumps({"id": sid, "reason": reason, "failed_at": now - age}) + b"\n"
            for sid, reason, age in (
                ("f1", "prompt too long: 40,000 tokens", 30),
                ("f3", "retries ran out: 503 Service Unavailable", 10),
            )
        )
    )

    view = dataset_detail(
        ledger.snapshot("B5"), ledger.spec("B5"), ledger.failures("B5"), [], last_failures(folder)
    )
    text = render(view, width)

    assert_fits(text, width)
    for figure in (
        "10,000,000 (10M)",  # the budget
        "1,000,000 (1M) of 10,000,000 (10M) tokens, 10%",
        "20 of 7,000 samples, 0%",
        "truncate: each generation may use at most what is left of the budget",
        "http://gen:30000",
        # the numbers people ask about: 20 samples of 50,000 tokens each
        "mean 50,000, p50 50,000, p95 50,000",
        "hit max_new_tokens 0 (0.0% of the samples)",
        "thinking tokens 0 (answers 1,000,000 (1M))",
        "projected final 10,000,000 (10M) tokens, 9,000,000 (9M) to go",
    ):
        assert figure in " ".join(text.split()), f"{figure!r} missing:\n{text}"
    lines = text.splitlines()
    by_reason = lines.index("failures by reason")
    assert lines[by_reason + 1].split() == ["2", "x", "prompt", "too", "long:", "40,000", "tokens"]
    assert lines[by_reason + 2].split()[:2] == ["1", "x"]
    last = lines.index("last errors")
    assert "f3: retries ran out: 503 Service Unavailable" in lines[last + 1]  # the newest first
    assert "f1: prompt too long" in lines[last + 2]


def test_status_name_prints_the_detail_view_and_an_unknown_name_lists_the_known_ones(
    ledger: Ledger, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    issue_datasets(ledger)

    assert main(["status", "--redis-url", redis_url, "B1_sharegpt"]) == 0
    out = capsys.readouterr().out
    assert "samples by outcome" in out and "20,467 of 20,000 tokens, 102%, 467 past it" in out

    for argv in (["B1_sharegpt", "B9_typo"], ["--json", "B9_typo"], ["--watch", "B9_typo"]):
        assert main(["status", "--redis-url", redis_url, *argv]) == EXIT_USAGE
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err.startswith("error: no dataset named 'B9_typo' in the ledger at "), captured.err
        assert captured.err.rstrip().endswith(
            f"known: B1_sharegpt, B2_opencodeinstruct, {LONG_NAME}, B4_big"
        ), captured.err
        assert "Traceback" not in captured.err


def test_status_names_with_all_shows_their_rows_and_json_keeps_its_fields(
    ledger: Ledger, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    issue_datasets(ledger)
    assert main(["status", "--redis-url", redis_url, "--all", "B4_big"]) == 0
    out = capsys.readouterr().out
    assert shows(out, "10.7M / 10M") and "B1_sharegpt" not in out

    assert main(["status", "--redis-url", redis_url, "--json", "B4_big"]) == 0
    body = orjson.loads(capsys.readouterr().out)
    (b4,) = body["datasets"]
    assert list(b4)[:10] == [
        "name",
        "state",
        "tokens",
        "token_budget",
        "samples",
        "max_samples",
        "failed",
        "dropped",
        "queued",
        "inflight",
    ]
    assert (b4["tokens"], b4["token_budget"], b4["eta_s"]) == (10_700_000, 10_000_000, 0)


def test_an_empty_ledger_and_an_unknown_export_say_how_to_rebuild_a_ledger_redis_lost(
    ledger: Ledger, redis_url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # what a user saw after a Redis restart without persistence: "no datasets", and no way forward
    assert main(["status", "--redis-url", redis_url]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith("no datasets in the ledger at ") and "tokenfleet reconcile --config CONFIG" in out

    assert main(["export", "gone", "-o", str(tmp_path / "x.jsonl"), "--redis-url", redis_url]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown dataset 'gone'") and "tokenfleet reconcile --config CONFIG" in err
    assert "Traceback" not in err and not (tmp_path / "x.jsonl").exists()
