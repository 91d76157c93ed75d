"""The status grid's choices at a given width, and the counts as a person reads them."""

from __future__ import annotations

import pytest
from rich.cells import cell_len
from rich.text import Text

from tests.support.status import render, shows
from tokenfleet.status_grid import Cell, Column, Grid
from tokenfleet.status_view import SILENT_AFTER_S, human, percent, workers_table


@pytest.mark.parametrize(
    ("n", "shown"),
    [
        (0, "0"),
        (150, "150"),
        (20_412, "20,412"),
        (99_999, "99,999"),
        (150_000, "150k"),
        (999_999, "1M"),  # not "1e+03k"
        (10_000_000, "10M"),
        (10_700_000, "10.7M"),
        (1_234_000_000, "1.23B"),
    ],
)
def test_a_count_reads_exact_below_100k_and_in_three_digits_and_a_unit_above(n: int, shown: str) -> None:
    assert human(n) == shown


def test_a_percentage_is_rounded_down_so_a_limit_not_reached_never_shows_100() -> None:
    assert (percent(149, 150), percent(150, 150), percent(10_700_000, 10_000_000)) == (99, 100, 107)


COLUMNS = (
    Column("name"),
    Column("figure", "right"),
    Column("note"),
    Column("extra", "right", core=False),
)
ROWS = [
    ["alpha", Cell(Text("1,234 / 2,000 61%"), bar=(1234, 2000)), "fine", "7"],
    ["a_much_longer_name_for_a_row", "12", "a note of several words", "8"],
]


def lines_of(grid: Grid, width: int) -> list[str]:
    return render(grid, width).splitlines()


def test_the_grid_shows_bars_and_extra_columns_when_there_is_room_and_drops_them_first() -> None:
    wide = lines_of(Grid(COLUMNS, ROWS), 120)
    assert wide[0].split() == ["name", "figure", "note", "extra"]
    assert "━" in wide[2] and shows(wide[2], "1,234 / 2,000 61%")

    # 66 columns: the core columns fit once the long name has a line of its own, without bars or extras
    narrow = lines_of(Grid(COLUMNS, ROWS, hint="see the detail view"), 66)
    assert narrow[0].split() == ["name", "figure", "note"]
    assert "━" not in "".join(narrow)
    assert "a_much_longer_name_for_a_row" in narrow  # alone on its line
    assert narrow[-1] == "extra: see the detail view"


def test_columns_that_do_not_fit_go_to_a_second_line_under_their_row_never_cut() -> None:
    lines = lines_of(Grid(COLUMNS, ROWS, min_core=1), 50)

    assert lines[0].split() == ["name", "figure"]
    assert all(cell_len(line) <= 50 for line in lines)
    assert "  note a note of several words" in lines


def test_a_terminal_too_narrow_for_the_first_columns_gets_one_line_per_figure() -> None:
    lines = lines_of(Grid(COLUMNS, ROWS, min_core=2), 26)

    assert all(cell_len(line) <= 26 for line in lines), lines
    assert "a_much_longer_name_for_a_row" not in lines  # 28 characters: folded, the only way
    at = lines.index("  figure: 1,234 / 2,000")  # wrapped between words, never inside a figure
    assert lines[at + 1] == "61%"
    assert "…" not in "".join(lines)


def test_a_worker_silent_for_longer_than_two_heartbeats_is_flagged() -> None:
    workers = [
        {"name": "w1", "version": "v", "inflight": 3, "concurrency": 8, "age_s": SILENT_AFTER_S + 1},
        {"name": "w2", "version": "v", "inflight": 0, "concurrency": 8, "age_s": 0.4},
    ]
    lines = lines_of(workers_table(workers, "v"), 80)

    w1 = next(line for line in lines if line.startswith("w1"))
    w2 = next(line for line in lines if line.startswith("w2"))
    assert w1.endswith("(silent)") and not w2.endswith("(silent)")
