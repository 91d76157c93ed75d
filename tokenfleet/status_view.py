"""How the fleet is shown: per-dataset figures with rates, ETA and projections, as JSON
(``status --json``) and as a rich view (``status``, ``status --watch``, ``submit``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from rich.console import Group, RenderableType
from rich.text import Text

from budget import DatasetSnapshot, DatasetState
from budget.server_board import ServerStatus
from tokenfleet.config import redact_url
from tokenfleet.status_grid import NOTHING, Cell, Column, Grid
from workers.heartbeat import HEARTBEAT_EVERY_S

#: A worker that has not beaten for this long is flagged: it beats at least every HEARTBEAT_EVERY_S.
SILENT_AFTER_S: Final = 2 * HEARTBEAT_EVERY_S + 1
#: A server's "up" older than this, with nothing running there, is shown with its age.
STALE_HEALTH_S: Final = 60.0
#: A dataset no producer has said it feeds for this long is fed by none (producers say so every second).
FED_STALE_S: Final = 10.0

#: The first fields of each dataset in ``status --json``, in order (the interface later checks drive).
STATUS_FIELDS: Final = (
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
)


_STATE_STYLE: Final = {"active": "green", "paused": "yellow", "exhausted": "cyan", "revoked": "red"}


def unfed(s: DatasetSnapshot) -> int | None:
    """Source samples not yet sent at all, once the source has been counted."""
    if not s.source_done:
        return None
    return max(0, s.source_total - s.samples - s.failed - s.pending - s.queued - s.inflight)


@dataclass(frozen=True, slots=True)
class Projection:
    """Where a dataset is heading, from its counters and its recent rates. A paused or revoked one
    (``halted``) is heading nowhere until resumed: its times are None (0 where nothing is left to do)."""

    #: Seconds until the token budget is reached at the current rate (None: no budget, or no rate yet).
    eta_budget_s: float | None
    #: Seconds until the source is done at the current sample rate (None until the source is counted).
    eta_source_s: float | None
    #: Seconds until the dataset settles: whichever comes first (0 when it has).
    eta_s: float | None
    #: Tokens past the budget: the actual figure once exhausted, else what its policy is expected to cost.
    overshoot_tokens: int | None
    #: Tokens generated and not kept: the discard policy's partial answers (actual, or expected).
    waste_tokens: int | None
    #: Committed tokens the dataset will end with (``projected_final_tokens``: see ``final_tokens``).
    final_tokens: int | None = None
    #: What is left of them to generate (less what runs now), and the seconds that takes the fleet at the
    #: current token rate: fleet (wall-clock) time, not GPU-seconds summed over the GPUs.
    remaining_tokens: int | None = None
    remaining_s: float | None = None
    #: Where a budgeted dataset stands (``budget_regime``): "full speed", "final stretch", "spent"; None
    #: without a token budget.
    regime: str | None = None


def budget_regime(s: DatasetSnapshot) -> str | None:
    """ "full speed" while every generation the servers take may start with all it may want; "final
    stretch" once the answers in flight are expected to fill what is left of the budget (at the mean length
    each): truncate grants each generation up to the budget's end and cuts the answers running then;
    discard and drain start fewer; "spent" once exhausted. None without a token budget (or once
    revoked)."""
    if s.token_budget is None or s.state == "revoked":
        return None
    if s.state == "exhausted":
        return "spent"
    mean = s.tokens / s.samples if s.samples else 0.0
    left = s.token_budget - s.tokens - s.discarded_tokens - s.live_tokens
    if left <= max(0.0, s.inflight * mean - s.live_tokens):
        return "final stretch"
    return "full speed"


def tail_s(s: DatasetSnapshot) -> float:
    """Seconds the last answers of a budget that keeps whole answers (discard, drain) run past what the
    token rate says: at its end fewer run, and the long ones finish last, at one stream's speed. 0 under
    truncate, whose last answers are cut at the budget."""
    if s.on_budget == "truncate" or not s.samples or s.tokens_per_s <= 0 or not s.inflight:
        return 0.0
    p95 = s.tokens_per_sample_p95 or 0
    per_stream = s.tokens_per_s / s.inflight
    return max(0.0, p95 - s.tokens / s.samples) / per_stream


def expected_samples(s: DatasetSnapshot) -> int | None:
    """Samples the dataset will have committed when its source is done: the source's samples less the
    failed ones, at most ``max_samples``; ``max_samples`` alone until the source is counted; None when
    neither is known."""
    expected = max(0, s.source_total - s.failed) if s.source_done else None
    if s.max_samples is not None:
        expected = s.max_samples if expected is None else min(expected, s.max_samples)
    return expected


def final_tokens(s: DatasetSnapshot) -> int | None:
    """The committed tokens a dataset will end with: what it has once settled; else the expected samples
    at the mean tokens per sample so far, at most what the budget leaves for committed tokens (its
    budget less the discarded tokens); a budgeted dataset whose expected samples are unknown (source not
    counted yet, no sample cap) is projected to reach its budget. None when nothing tells: no budget, and
    no sample yet or the expected samples unknown."""
    if s.settled or s.state == "revoked":
        return s.tokens
    mean = s.tokens_per_sample
    expected = expected_samples(s)
    by_samples = round(expected * mean) if expected is not None and mean is not None else None
    final = by_samples
    if s.token_budget is not None:
        room = max(0, s.token_budget - s.discarded_tokens)
        final = room if by_samples is None else min(room, by_samples)
    return None if final is None else max(final, s.tokens)


def halted(s: DatasetSnapshot) -> bool:
    """Paused or revoked: it makes no progress until an operator resumes it, whatever rate its last
    30 seconds show, so no time is projected for it (its ETA and time left are None)."""
    return s.state in (DatasetState.PAUSED, DatasetState.REVOKED)


def project(s: DatasetSnapshot) -> Projection:
    spent = s.tokens + s.discarded_tokens
    mean = s.tokens / s.samples if s.samples else 0.0
    # The rates every time below is projected at: none while halted.
    tokens_per_s, samples_per_s = (0.0, 0.0) if halted(s) else (s.tokens_per_s, s.samples_per_s)
    eta_budget = eta_source = None
    if s.token_budget is not None and tokens_per_s > 0:
        eta_budget = max(0.0, s.token_budget - spent - s.live_tokens) / tokens_per_s + tail_s(s)
    left = unfed(s)
    if left is not None and samples_per_s > 0:
        eta_source = (left + s.pending + s.queued + s.inflight) / samples_per_s
    overshoot = waste = None
    if s.token_budget is not None:
        if s.state == "exhausted":
            overshoot = max(0, spent - s.token_budget)
            waste = s.discarded_tokens
        elif s.on_budget == "drain":  # the running generations finish: their expected rest
            overshoot, waste = int(max(0.0, s.inflight * mean - s.live_tokens)), 0
        else:  # truncate: every generation holds a grant of the budget (budget/lua/_lib.lua); discard:
            # nothing passes the budget, and what is thrown away is known once it is reached
            overshoot, waste = 0, 0
    if s.settled:
        eta: float | None = 0.0
    else:
        known = [e for e in (eta_budget, eta_source) if e is not None]
        eta = min(known) if known else None
    final = final_tokens(s)
    remaining = remaining_s = None
    if final is not None:
        remaining = max(0, final - s.tokens - s.live_tokens)
        if remaining == 0:
            remaining_s = 0.0
        elif tokens_per_s > 0:
            remaining_s = remaining / tokens_per_s
    return Projection(
        eta_budget, eta_source, eta, overshoot, waste, final, remaining, remaining_s, budget_regime(s)
    )


def snapshot_json(s: DatasetSnapshot) -> dict[str, Any]:
    p = project(s)
    out: dict[str, Any] = {
        "name": s.name,
        "state": s.state,
        "tokens": s.tokens,
        "token_budget": s.token_budget,
        "samples": s.samples,
        "max_samples": s.max_samples,
        "failed": s.failed,
        "dropped": s.pending,
        "queued": s.queued,
        "inflight": s.inflight,
    }
    return out | {
        "on_budget": s.on_budget,
        "live_tokens": s.live_tokens,
        "truncated": s.truncated,
        "discarded_tokens": s.discarded_tokens,
        "wasted_tokens": s.wasted_tokens,
        "rejected": s.rejected,
        "reclaimed": s.reclaimed,
        "source_total": s.source_total if s.source_done else None,
        "unfed": unfed(s),
        "settled": s.settled,
        "fed_s_ago": _round(s.fed_s_ago),
        "nothing_feeds": nothing_feeds(s),
        "tokens_per_s": round(s.tokens_per_s, 1),
        "samples_per_s": round(s.samples_per_s, 2),
        "eta_budget_s": _round(p.eta_budget_s),
        "eta_source_s": _round(p.eta_source_s),
        "eta_s": _round(p.eta_s),
        "budget_regime": p.regime,
        "projected_overshoot_tokens": p.overshoot_tokens,
        "projected_waste_tokens": p.waste_tokens,
        "reasoning_tokens": s.reasoning_tokens,
        "answer_tokens": s.answer_tokens,
        "tokens_per_sample_mean": _round(s.tokens_per_sample),
        "tokens_per_sample_p50": s.tokens_per_sample_p50,
        "tokens_per_sample_p95": s.tokens_per_sample_p95,
        "longest_sample_tokens": s.longest if s.samples else None,
        "hit_max_new": s.hit_max_new,
        "hit_max_new_share": None if s.hit_max_new_share is None else round(s.hit_max_new_share, 4),
        "projected_final_tokens": p.final_tokens,
        "projected_remaining_tokens": p.remaining_tokens,
        "projected_remaining_s": _round(p.remaining_s),
        "output_error": s.output_error,
        "held": s.held,
        "held_bytes": s.held_bytes,
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def duration(seconds: float | None) -> str:
    if seconds is None:
        return NONE
    s = int(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


#: Shown for a figure that does not apply (no rate of a settled dataset, no budget, no error).
NONE: Final = NOTHING


def human(n: int) -> str:
    """A count a person reads at once: exact below 100,000 (``20,412``), else three significant digits
    and a unit (``150k``, ``10.7M``, ``10M``, ``1.23B``)."""
    if abs(n) < 100_000:
        return f"{n:,}"
    for div, unit in ((1e3, "k"), (1e6, "M"), (1e9, "B")):
        short = f"{n / div:.3g}"
        if abs(float(short)) < 1000:
            return short + unit
    return f"{n / 1e12:,.3g}T"


def percent(value: int, limit: int) -> int:
    """Whole percent, rounded down: 149 of 150 is 99%, not 100%."""
    return 100 * value // limit if limit > 0 else 100


def against(value: int, limit: int | None) -> Cell:
    """``value / limit pct%`` (with a bar where there is room), or ``value`` alone when there is no limit."""
    if limit is None:
        return Cell(Text(human(value)))
    style = "bold" if value >= limit else ""
    text = Text(f"{human(value)} / {human(limit)} ", style=style) + Text(
        f"{percent(value, limit)}%", style="dim"
    )
    return Cell(text, bar=(value, limit))


def state_text(s: DatasetSnapshot) -> Text:
    """The ledger's state; an active dataset whose source is all done is ``finished``."""
    if s.state == "active" and s.settled:
        return Text("finished", style="green")
    return Text(s.state, style=_STATE_STYLE.get(s.state, ""))


def rate_text(s: DatasetSnapshot) -> Text:
    """Tokens per second; nothing for a settled dataset (its last minute's rate is history)."""
    return Text(NONE, style="dim") if s.settled else Text(f"{s.tokens_per_s:,.0f}")


def eta_text(s: DatasetSnapshot, p: Projection) -> Text:
    if s.settled:
        return Text("done", style="green")
    return Text(duration(p.eta_s), style="" if p.eta_s is not None else "dim")


def nothing_feeds(s: DatasetSnapshot) -> bool:
    """Whether ``s`` is active with samples left to feed and no producer feeding it: submit stopped, or was
    not run again after a resume or a raised limit. They wait, not lost, for the next ``tokenfleet
    submit``; until then nothing else happens to them."""
    if s.state != DatasetState.ACTIVE or s.queued:
        return False
    left = s.pending > 0 or not s.source_done or bool(unfed(s))
    return left and (s.fed_s_ago is None or s.fed_s_ago > FED_STALE_S)


def problems_text(s: DatasetSnapshot) -> Text:
    parts = []
    if nothing_feeds(s):
        parts.append(Text("no submit feeding it", style="bold yellow"))
    if s.output_error:
        parts.append(Text("output unwritable", style="bold red"))
    if s.failed:
        parts.append(Text(f"{human(s.failed)} failed", style="red"))
    if s.rejected:
        parts.append(Text(f"{human(s.rejected)} rejected", style="yellow"))
    return Text(", ").join(parts) if parts else Text(NONE, style="dim")


#: The dataset grid's columns: the core ones first (they move to a second line when the terminal is too
#: narrow), then the extras (left out then: ``tokenfleet status NAME`` has them).
DATASET_COLUMNS: Final = (
    Column("dataset"),
    Column("state"),
    Column("tokens / budget"),
    Column("samples / cap"),
    Column("tok/s", "right"),
    Column("ETA", "right"),
    Column("in flight", "right"),
    Column("problems"),
    Column("queued", "right", core=False),
    Column("req/s", "right", core=False),
    Column("dropped", "right", core=False),
    Column("overshoot", "right", core=False),
    Column("waste", "right", core=False),
)


def dataset_row(s: DatasetSnapshot) -> list[str | Text | Cell]:
    p = project(s)
    return [
        Text(s.name, style="bold"),
        state_text(s),
        against(s.tokens, s.token_budget),
        against(s.samples, s.max_samples),
        rate_text(s),
        eta_text(s, p),
        human(s.inflight),
        problems_text(s),
        human(s.queued),
        Text(NONE, style="dim") if s.settled else f"{s.samples_per_s:,.1f}",
        human(s.pending),
        NONE if p.overshoot_tokens is None else human(p.overshoot_tokens),
        NONE if p.waste_tokens is None else human(p.waste_tokens),
    ]


def status_table(snapshots: Sequence[DatasetSnapshot], title: str | None = None) -> Grid:
    """One row per dataset: progress against its limits, rate, ETA, in flight, problems, and (where there
    is room) the queue and the projections. It fits any terminal width without cutting a name or a
    number (``tokenfleet.status_grid``)."""
    return Grid(
        DATASET_COLUMNS,
        (dataset_row(s) for s in snapshots),
        title=title,
        min_core=3,
        hint="see tokenfleet status NAME",
    )


def workers_table(workers: Sequence[dict[str, Any]], my_version: str) -> Grid:
    """The workers online; one running other code than ``my_version`` is flagged in red. A worker's in
    flight figure is as of its last heartbeat (``last seen``): a worker beats when it changes, and at
    least every ``HEARTBEAT_EVERY_S``, so a worker silent for longer is flagged."""
    rows: list[list[str | Text | Cell]] = []
    for w in workers:
        stale = w.get("version") != my_version
        version = Text(str(w.get("version")), style="bold red" if stale else "green")
        if stale:
            version.append(f" (submitter runs {my_version})", style="red")
        age = float(w.get("age_s", 0))
        silent = age > SILENT_AFTER_S
        seen = Text(f"{age:.0f}s ago" + (" (silent)" if silent else ""), style="yellow" if silent else "")
        rows.append(
            [str(w["name"]), version, str(w.get("inflight", "?")), str(w.get("concurrency", "?")), seen]
        )
    return Grid(
        (
            Column("worker"),
            Column("version"),
            Column("in flight", "right"),
            Column("concurrency", "right"),
            Column("last seen", "right"),
        ),
        rows,
        title="workers online",
    )


def server_health(s: ServerStatus) -> Text:
    """ "up" or "down" as the workers last found it; an "up" that no generation has confirmed for
    ``STALE_HEALTH_S`` while none runs there says how old it is (no worker may be looking any more)."""
    if not s.up:
        return Text("down", style="bold red")
    if s.inflight == 0 and s.last_ok_s_ago is not None and s.last_ok_s_ago >= STALE_HEALTH_S:
        return Text(f"up {duration(s.last_ok_s_ago)} ago", style="yellow")
    return Text("up", style="green")


def servers_table(servers: Sequence[ServerStatus]) -> Grid:
    """Each server's health, in-flight generations against its fleet-wide cap, and request rate."""
    rows: list[list[str | Text | Cell]] = []
    for s in servers:
        health = server_health(s)
        cap = NONE if s.cap is None else f"{s.cap:,}"
        error = Text(s.last_error or NONE, style="red" if not s.up else "dim")
        rows.append(
            [
                redact_url(s.url),
                health,
                f"{s.inflight:,} / {cap}",
                f"{s.requests_per_s:,.1f}",
                f"{s.failures:,} ({s.fails_in_a_row})",
                error,
            ]
        )
    return Grid(
        (
            Column("server"),
            Column("health"),
            Column("in flight / cap", "right"),
            Column("req/s", "right"),
            Column("failures (in a row)", "right"),
            Column("last error"),
        ),
        rows,
        title="servers",
    )


def fleet_view(
    snapshots: Sequence[DatasetSnapshot],
    workers: Sequence[dict[str, Any]],
    my_version: str,
    title: str | None = None,
    servers: Sequence[ServerStatus] = (),
) -> RenderableType:
    parts: list[RenderableType] = [status_table(snapshots, title)]
    for s in snapshots:
        if s.output_error:
            parts.append(Text(f"{s.name}: output not writable: {s.output_error}", style="bold red"))
    if servers:
        parts += [Text(""), servers_table(servers)]
    parts.append(Text(""))
    if workers:
        parts.append(workers_table(workers, my_version))
    else:
        parts.append(Text("no worker online (start one: tokenfleet worker)", style="yellow"))
    return Group(*parts)


def workers_json(workers: Sequence[dict[str, Any]], my_version: str) -> list[dict[str, Any]]:
    return [w | {"stale": w.get("version") != my_version} for w in workers]
