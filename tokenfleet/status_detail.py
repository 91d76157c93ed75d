"""``tokenfleet status NAME``: one dataset in full, at any terminal width. Its limits and policy, its
progress, its samples by outcome, its tokens, its servers, its failures by reason and its last errors:
what the fleet view has no room for."""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import orjson
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.measure import Measurement
from rich.text import Text

from budget import DatasetSnapshot
from budget.server_board import ServerStatus
from tokenfleet.config import redact_url
from tokenfleet.status_grid import bar_text
from tokenfleet.status_view import (
    NONE,
    duration,
    eta_text,
    human,
    percent,
    problems_text,
    project,
    servers_table,
    state_text,
    unfed,
)

#: Failure reasons listed (the most frequent), and last errors shown.
TOP_REASONS: Final = 10
LAST_ERRORS: Final = 5
#: Bytes read from the end of each failure file for its last records.
TAIL_BYTES: Final = 64 * 1024
#: A label column wider than this, or a terminal narrower than label + this, puts values under labels.
MAX_LABEL: Final = 24
MIN_VALUE: Final = 24

#: What each on_budget policy does, in a few words.
POLICIES: Final = {
    "truncate": "truncate: each generation may use at most what is left of the budget; the last ones are "
    "cut there and kept",
    "discard": "discard: a generation starts only when max_new_tokens still fit in the budget; none is cut",
    "drain": "drain: generations running at the budget finish (past it); no new one starts",
}


@dataclass(frozen=True, slots=True)
class Section:
    heading: str
    items: Sequence[tuple[str, Text]]


class Fields:
    """Sections of ``label  value`` lines; a value too long for its line wraps under itself, and on a
    narrow terminal it goes under its label."""

    def __init__(self, sections: Iterable[Section]) -> None:
        self.sections = [s for s in sections if s.items]

    def lines(self, width: int) -> list[Text]:
        label_w = min(MAX_LABEL, max((cell_len(k) for s in self.sections for k, _ in s.items), default=0))
        beside = width >= label_w + 2 + MIN_VALUE
        out: list[Text] = []
        for section in self.sections:
            out.append(Text(section.heading, style="bold underline"))
            for label, value in section.items:
                if beside and cell_len(label) <= label_w:
                    indent = label_w + 2
                    first = Text(label.ljust(label_w + 2), style="dim")
                else:
                    out.append(Text(label, style="dim"))
                    indent, first = 2, Text("  ")
                wrapped = value.wrap(Console(width=width), width - indent, overflow="fold")
                for i, part in enumerate(wrapped):
                    part.rstrip()
                    out.append((first if i == 0 else Text(" " * indent)) + part)
            out.append(Text(""))
        return out

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        for line in self.lines(options.max_width):
            line.no_wrap = True
            line.end = "\n"
            yield line

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement(1, options.max_width)


def exact(n: int) -> str:
    """``20,412``, or ``10,700,000 (10.7M)`` where the short form helps."""
    short = human(n)
    return f"{n:,}" if short == f"{n:,}" else f"{n:,} ({short})"


def _against(value: int, limit: int | None, unit: str) -> Text:
    if limit is None:
        return Text(f"{exact(value)} {unit} (no limit)")
    out = bar_text(value, limit) + Text(f" {exact(value)} of {exact(limit)} {unit}, {percent(value, limit)}%")
    if value > limit:
        out.append(f", {exact(value - limit)} past it", style="yellow")
    return out


def failures_by_reason(failures: Mapping[str, str]) -> list[tuple[str, int]]:
    """Reasons, most frequent first (ties by reason)."""
    counts = Counter(failures.values())
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


def last_failures(folder: Path, n: int = LAST_ERRORS) -> list[dict[str, Any]]:
    """The ``n`` newest failure records under ``folder`` (``failed-*.jsonl``, as workers write them), or
    none when the folder is not readable from here."""
    records: list[dict[str, Any]] = []
    with contextlib.suppress(OSError):
        for path in folder.glob("failed-*.jsonl"):
            with path.open("rb") as f:
                size = f.seek(0, 2)
                f.seek(max(0, size - TAIL_BYTES))
                lines = f.read().splitlines()
            if size > TAIL_BYTES:
                lines = lines[1:]  # the first may be cut
            for line in lines:
                with contextlib.suppress(orjson.JSONDecodeError):
                    rec = orjson.loads(line)
                    if isinstance(rec, dict):
                        records.append(rec)
    records.sort(key=lambda r: float(r.get("failed_at") or 0), reverse=True)
    return records[:n]


def dataset_detail(
    s: DatasetSnapshot,
    spec: Mapping[str, Any],
    failures: Mapping[str, str],
    servers: Sequence[ServerStatus],
    last_errors: Sequence[dict[str, Any]] = (),
    pending_reasons: Mapping[str, int] | None = None,
) -> RenderableType:
    """Everything about one dataset: the fleet view's row, and what it has no room for; ``pending_reasons``:
    why the samples to feed again went back (``Ledger.pending_reasons``)."""
    p = project(s)
    sampling = spec.get("sampling") or {}
    limits = [
        ("token budget", Text(NONE if s.token_budget is None else exact(s.token_budget))),
        ("max samples", Text(NONE if s.max_samples is None else exact(s.max_samples))),
        ("at the budget", Text(POLICIES.get(s.on_budget, s.on_budget))),
        ("max new tokens", Text(str(sampling.get("max_new_tokens", NONE)))),
    ]
    left = unfed(s)
    source = (
        Text("not counted yet")
        if left is None
        else Text(f"{exact(s.source_total)} lines, {exact(left)} not sent yet")
    )
    state = state_text(s)
    if s.settled:
        state.append(" (settled: nothing queued or in flight)", style="dim")
    progress = [
        ("state", state),
        ("tokens", _against(s.tokens, s.token_budget, "tokens")),
        ("samples", _against(s.samples, s.max_samples, "samples")),
        ("source", source),
        (
            "rate",
            Text(f"{NONE} (settled)", style="dim")
            if s.settled
            else Text(f"{s.tokens_per_s:,.0f} tok/s, {s.samples_per_s:,.1f} samples/s (last 30 s)"),
        ),
        ("ETA", eta_text(s, p)),
    ]
    if not s.settled and (p.eta_budget_s is not None or p.eta_source_s is not None):
        progress.append(
            (
                "ETA by",
                Text(f"budget {duration(p.eta_budget_s)}, source {duration(p.eta_source_s)}"),
            )
        )
    if p.regime is not None:
        progress.append(("budget", Text(p.regime, style="yellow" if p.regime == "final stretch" else "")))
    progress.append(("problems", problems_text(s)))
    outcomes = [
        ("committed", Text(exact(s.samples))),
        ("  of them truncated", Text(exact(s.truncated))),
        ("failed", Text(exact(s.failed), style="red" if s.failed else "")),
        ("rejected (bad lines)", Text(exact(s.rejected), style="yellow" if s.rejected else "")),
        ("dropped, to feed again", Text(exact(s.pending))),
        *(
            (f"  {reason}", Text(exact(count)))
            for reason, count in sorted((pending_reasons or {}).items(), key=lambda rc: (-rc[1], rc[0]))
        ),
        ("queued", Text(exact(s.queued))),
        ("in flight", Text(exact(s.inflight))),
        ("reclaimed (expired)", Text(exact(s.reclaimed))),
    ]
    tokens = [
        ("committed", Text(exact(s.tokens))),
        ("in flight (live)", Text(exact(s.live_tokens))),
        ("discarded (policy)", Text(exact(s.discarded_tokens))),
        ("wasted (generated, not kept)", Text(exact(s.wasted_tokens))),
        (
            "past the budget" if s.state == "exhausted" else "projected overshoot",
            Text(NONE if p.overshoot_tokens is None else exact(p.overshoot_tokens)),
        ),
        (
            "thrown away" if s.state == "exhausted" else "projected waste",
            Text(NONE if p.waste_tokens is None else exact(p.waste_tokens)),
        ),
    ]

    def tok(v: float | None) -> str:
        return NONE if v is None else f"{v:,.0f}"

    share = s.hit_max_new_share
    per_sample = [
        (
            "tokens per sample",
            Text(
                f"mean {tok(s.tokens_per_sample)}, p50 {tok(s.tokens_per_sample_p50)}, "
                f"p95 {tok(s.tokens_per_sample_p95)} (a bucket's upper bound)"
            ),
        ),
        (
            "hit max_new_tokens",
            Text(NONE if share is None else f"{exact(s.hit_max_new)} ({share:.1%} of the samples)"),
        ),
        ("thinking tokens", Text(f"{exact(s.reasoning_tokens)} (answers {exact(s.answer_tokens)})")),
        (
            "projected final",
            Text(
                NONE
                if p.final_tokens is None
                else f"{exact(p.final_tokens)} tokens, {exact(p.remaining_tokens or 0)} to go, "
                f"{duration(p.remaining_s)} at the current rate"
            ),
        ),
    ]
    reasons = [(f"{count:,} x", Text(reason, style="red")) for reason, count in failures_by_reason(failures)]
    if len(reasons) > TOP_REASONS:
        rest = sum(c for _, c in failures_by_reason(failures)[TOP_REASONS:])
        reasons = [*reasons[:TOP_REASONS], (f"{rest:,} x", Text("other reasons", style="dim"))]
    errors: list[tuple[str, Text]] = []
    if s.output_error:
        errors.append(("output", Text(f"not writable: {s.output_error}", style="bold red")))
    for rec in last_errors:
        when = float(rec.get("failed_at") or 0)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when)) if when else "?"
        errors.append((stamp, Text(f"{rec.get('id', '?')}: {rec.get('reason', '?')}", style="red")))
    parts: list[RenderableType] = [
        Text(s.name, style="bold"),
        Text(""),
        Fields(
            [
                Section("limits", limits),
                Section("progress", progress),
                Section("samples by outcome", outcomes),
                Section("tokens", tokens),
                Section("per sample", per_sample),
                Section("failures by reason", reasons),
                Section("last errors", errors),
            ]
        ),
    ]
    urls = [str(u) for u in spec.get("servers") or ()]
    mine = [sv for sv in servers if sv.url in urls]
    if mine:
        parts.append(servers_table(mine))
    elif urls:
        parts.append(Text("servers: " + ", ".join(redact_url(u) for u in urls)))
    return Group(*parts)
