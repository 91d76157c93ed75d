"""A limit set live (``tokenfleet budget``) against submit run again: the newer intent wins, for each limit on
its own (``budget/lua/register.lua``). An unchanged config keeps the live value, and submit says so; a
config edited since applies its value; with nothing set live the config's value applies, as always."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from budget import DatasetLimits, DatasetState, Ledger
from budget.keys import dataset_keys
from tests.support.files import write_config
from tests.support.ledger import DS, SPEC, commit_new
from tokenfleet.cli import main

pytestmark = pytest.mark.redis

#: A server no test reaches: submit runs with --no-server-check, and learns nothing from it.
NO_SERVER = "http://127.0.0.1:1"


def submit_again(
    ledger: Ledger, token_budget: int | None, max_samples: int | None = None
) -> tuple[str, dict[str, int | None]]:
    """Register ``DS`` as a submit of a config with these limits does."""
    return ledger.register(DS, DatasetLimits(token_budget, max_samples, "truncate"), SPEC)


def limits(ledger: Ledger) -> tuple[int | None, int | None]:
    snap = ledger.snapshot(DS)
    return snap.token_budget, snap.max_samples


def test_registering_a_new_dataset_applies_the_configs_limits_and_keeps_nothing(ledger: Ledger) -> None:
    assert submit_again(ledger, 60_000, 1_000) == (DatasetState.ACTIVE, {})
    assert limits(ledger) == (60_000, 1_000)


def test_a_budget_lowered_live_stays_and_the_dataset_stays_exhausted_when_submit_runs_again_unchanged(
    ledger: Ledger,
) -> None:
    submit_again(ledger, 60_000)
    commit_new(ledger, "s1", 50)
    assert ledger.set_limits(DS, 40) == DatasetState.EXHAUSTED

    # Crash recovery, then compose restarting the producer: each run keeps the operator's budget.
    for _ in range(2):
        assert submit_again(ledger, 60_000) == (DatasetState.EXHAUSTED, {"token_budget": 40})
        assert limits(ledger) == (40, None)


def test_a_config_edited_after_the_live_change_applies_its_value_and_the_live_mark_is_forgotten(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    submit_again(ledger, 60_000)
    commit_new(ledger, "s1", 50)
    ledger.set_limits(DS, 40)
    assert submit_again(ledger, 60_000)[1] == {"token_budget": 40}  # kept while the config is unchanged

    assert submit_again(ledger, 70_000) == (DatasetState.ACTIVE, {})

    assert limits(ledger) == (70_000, None)
    assert redis_client.hget(dataset_keys(DS).ledger_hash, "token_budget_set_live") is None
    # Back to the config's old value: the config changed again, so it applies too.
    assert submit_again(ledger, 60_000) == (DatasetState.ACTIVE, {})
    assert limits(ledger) == (60_000, None)


def test_without_a_live_change_submit_applies_the_configs_limits_as_before(ledger: Ledger) -> None:
    submit_again(ledger, 60_000, 1_000)

    assert submit_again(ledger, 5_000, 10) == (DatasetState.ACTIVE, {})
    assert limits(ledger) == (5_000, 10)


def test_each_limit_is_kept_or_replaced_on_its_own(ledger: Ledger) -> None:
    submit_again(ledger, 60_000, 1_000)
    ledger.set_limits(DS, 5_000)  # the budget only: the sample cap was not set live

    assert submit_again(ledger, 60_000, 2_000)[1] == {"token_budget": 5_000}
    assert limits(ledger) == (5_000, 2_000)

    ledger.set_limits(DS, 6_000, 300)
    # The budget's config value is unchanged (kept), the cap's was edited (applied).
    assert submit_again(ledger, 60_000, 2_500)[1] == {"token_budget": 6_000}
    assert limits(ledger) == (6_000, 2_500)

    ledger.set_limits(DS, "-", 300)
    # And the other way round: the budget's config edited, the cap's not.
    assert submit_again(ledger, 65_000, 2_500)[1] == {"max_samples": 300}
    assert limits(ledger) == (65_000, 300)


def test_a_limit_removed_live_stays_removed_while_the_config_is_unchanged(ledger: Ledger) -> None:
    submit_again(ledger, 60_000, 1_000)
    ledger.set_limits(DS, None, None)

    assert submit_again(ledger, 60_000, 1_000)[1] == {"token_budget": None, "max_samples": None}
    assert limits(ledger) == (None, None)


def test_a_live_value_the_config_already_brings_is_not_reported_as_kept(ledger: Ledger) -> None:
    submit_again(ledger, 60_000)
    ledger.set_limits(DS, 60_000)

    assert submit_again(ledger, 60_000) == (DatasetState.ACTIVE, {})
    assert limits(ledger) == (60_000, None)


def test_a_set_limits_that_changes_nothing_marks_no_limit_live(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    submit_again(ledger, 60_000, 1_000)

    ledger.set_limits(DS)  # what reconcile runs to apply the limits again

    marks = redis_client.hmget(
        dataset_keys(DS).ledger_hash, ["token_budget_set_live", "max_samples_set_live"]
    )
    assert marks == [None, None]


def test_a_dataset_registered_by_an_older_version_takes_the_configs_limits_as_before(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    submit_again(ledger, 60_000, 1_000)
    # An older version recorded no config value.
    redis_client.hdel(dataset_keys(DS).ledger_hash, "config_token_budget", "config_max_samples")
    ledger.set_limits(DS, 5_000, 10)

    assert submit_again(ledger, 60_000, 1_000) == (DatasetState.ACTIVE, {})
    assert limits(ledger) == (60_000, 1_000)


def test_submit_run_again_says_in_one_line_per_limit_that_it_keeps_the_values_set_live(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(
        tmp_path,
        redis_url=redis_url,
        servers=[NO_SERVER],
        datasets=[{"name": "live", "rows": [], "token_budget": 60_000, "max_samples": 1_000}],
    )
    assert main(["submit", str(config), "--no-server-check"]) == 0
    assert main(["budget", "live", "5000", "--max-samples", "20", "--redis-url", redis_url]) == 0
    capsys.readouterr()

    assert main(["submit", str(config), "--no-server-check"]) == 0

    out = capsys.readouterr().out.splitlines()
    assert (
        "live: keeping the token budget set live (5,000); the config says 60,000 — change it with "
        "`tokenfleet budget live` or edit the config"
    ) in out
    assert (
        "live: keeping the sample cap set live (20); the config says 1,000 — change it with "
        "`tokenfleet budget live` or edit the config"
    ) in out
    snap = Ledger(redis_client).snapshot("live")
    assert (snap.token_budget, snap.max_samples) == (5_000, 20)
