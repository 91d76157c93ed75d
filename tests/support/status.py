"""What ``tokenfleet status`` is tested against: the issue's datasets, settled, in a real ledger (by the
ledger's own scripts, as workers drive them), and the view rendered as a person's terminal shows it."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console, RenderableType

from budget import CommitOutcome, DatasetLimits, Ledger
from tests.support.ledger import SPEC, lease

#: A dataset name of 40 characters (the longest the issue asks about).
LONG_NAME = "B3_a_very_long_dataset_name_for_evals_v2"


@dataclass(frozen=True, slots=True)
class Shown:
    """A dataset as the view must show it: its name and the figures a person looks for, as written."""

    name: str
    figures: tuple[str, ...]


def commit_many(ledger: Ledger, name: str, prefix: str, sizes: list[int]) -> None:
    """Admit every sample first, then commit each with its size (so the last commits may pass a budget,
    as in-flight generations do)."""
    for i in range(len(sizes)):
        lease(ledger, f"{prefix}{i}", f"{prefix}{i}-a", name=name)
    for i, size in enumerate(sizes):
        outcome = ledger.commit(name, f"{prefix}{i}", f"{prefix}{i}-a", size, False)
        assert outcome is CommitOutcome.COMMITTED, outcome


def issue_datasets(ledger: Ledger) -> list[Shown]:
    """The issue's two datasets after they settled (``B1_sharegpt``, 20,000-token budget;
    ``B2_opencodeinstruct``, 150-sample cap), one at 10.7M of a 10M budget, and one with a 40-character
    name still running with failures and rejected lines. What each must show, formatted as the view
    writes it."""
    ledger.register("B1_sharegpt", DatasetLimits(token_budget=20_000), SPEC)
    commit_many(ledger, "B1_sharegpt", "s", [211] * 97)  # 20,467 tokens: past the budget
    ledger.set_source("B1_sharegpt", total=1000, done=True)

    ledger.register("B2_opencodeinstruct", DatasetLimits(max_samples=150), SPEC)
    commit_many(ledger, "B2_opencodeinstruct", "c", [209] * 150)  # 31,350 tokens
    ledger.set_source("B2_opencodeinstruct", total=500, done=True)

    ledger.register("B4_big", DatasetLimits(token_budget=10_000_000), SPEC)
    commit_many(ledger, "B4_big", "b", [100_000] * 107)  # 10.7M of 10M
    ledger.set_source("B4_big", total=200, done=True)

    ledger.register(LONG_NAME, DatasetLimits(token_budget=5_000_000, max_samples=7000), SPEC)
    commit_many(ledger, LONG_NAME, "l", [1234] * 12)  # 14,808 tokens, 12 samples
    lease(ledger, "f1", "f1-a", name=LONG_NAME)
    ledger.fail(LONG_NAME, "f1", "f1-a", "server rejected the request: 400 prompt too long")
    lease(ledger, "running", "running-a", name=LONG_NAME)  # one in flight: not settled
    ledger.set_source(LONG_NAME, rejected=3)
    ledger.fed(LONG_NAME)  # a submit feeds it

    return [
        Shown("B1_sharegpt", ("exhausted", "20,467 / 20,000", "102%", "97", "done")),
        Shown("B2_opencodeinstruct", ("exhausted", "31,350", "150 / 150", "100%", "done")),
        Shown("B4_big", ("10.7M / 10M", "107%", "107", "done")),
        Shown(LONG_NAME, ("active", "14,808 / 5M", "12 / 7,000", "1 failed", "3 rejected")),
    ]


def render(renderable: RenderableType, width: int) -> str:
    """What a terminal ``width`` columns wide shows: plain text, no colour codes."""
    console = Console(width=width, color_system=None, force_terminal=False, legacy_windows=False)
    with console.capture() as capture:
        console.print(renderable)
    return capture.get()


def shows(text: str, figure: str) -> bool:
    """``figure`` appears whole in ``text``, on one line: no letter, digit or ``,`` / ``.`` of a longer
    figure right before it, and none right after it (a comma that ends a list may follow)."""
    pattern = rf"(?<![\w,.…]){re.escape(figure)}(?!\w|[,.…]\w|…)"
    return re.search(pattern, text) is not None


class Terminal:
    """A real terminal of ``width`` x ``height`` cells (tmux, on a server of its own), running one
    command; ``screen()`` is what a person sees in it now."""

    def __init__(self, argv: list[str], width: int, height: int = 60) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="tokenfleet-tmux-"))
        self.socket = str(self.folder / "socket")  # a tmux server of its own, removed by close()
        self.width = width
        command = " ".join(shlex.quote(a) for a in argv)
        self._tmux(
            "new-session", "-d", "-s", "t", "-x", str(width), "-y", str(height),
            f"{command}; echo '[exit '$?']'; sleep 600",
        )  # fmt: skip

    def _tmux(self, *args: str) -> str:
        done = subprocess.run(
            ["tmux", "-S", self.socket, *args], capture_output=True, text=True, timeout=10, check=True
        )
        return done.stdout

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", "t")

    def keys(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", "t", *keys)

    def close(self) -> None:
        subprocess.run(["tmux", "-S", self.socket, "kill-server"], capture_output=True, timeout=10)
        shutil.rmtree(self.folder, ignore_errors=True)
