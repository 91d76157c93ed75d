"""The ``tokenfleet`` command."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import orjson
from rich.console import Console, Group, RenderableType
from rich.markup import escape

from budget import DatasetSnapshot, Ledger, LedgerError, UnknownDataset
from budget.urls import REDIS_URL_ENV, redis_url_from_env
from producer.source import SourceError
from tokenfleet import __version__
from tokenfleet.config import ConfigError, load_config, redact_url
from tokenfleet.config.models import check_redis_url
from tokenfleet.entry import EXIT_INTERRUPTED
from tokenfleet.export import EXPORT_FORMATS, ExportReport
from tokenfleet.processes import KeptProcesses
from tokenfleet.status_view import fleet_view, snapshot_json, status_table, workers_json
from workers.settings import DEFAULT_CONCURRENCY

#: Exit codes.
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
#: submit stopped before every dataset settled (no progress and no worker online); it says what is left.
EXIT_UNSETTLED = 3


#: What to do where the ledger does not know a dataset that ran: Redis restarted without its data.
LOST_LEDGER_HINT = (
    "if it ran and this Redis lost its data (a restart without persistence, a flush), "
    "`tokenfleet reconcile --config CONFIG` rebuilds the ledger from the output files, "
    "and `tokenfleet submit CONFIG` then feeds what is not done"
)


def _redis_url(args: argparse.Namespace) -> str:
    """The ledger's Redis URL: ``--redis-url``, else ``$TOKENFLEET_REDIS_URL``, else the default. It is
    checked as the config checks its ``redis_url``: a malformed one is a ``ConfigError`` naming where it
    came from, not redis-py's ``ValueError`` (nor a worker retrying Celery's default broker)."""
    option = getattr(args, "redis_url", None)
    url, where = (str(option), "--redis-url") if option else (redis_url_from_env(), REDIS_URL_ENV)
    try:
        return check_redis_url(url)
    except ValueError as e:
        raise ConfigError(str(e), file=where) from None


def _ledger(args: argparse.Namespace) -> Ledger:
    ledger = Ledger.from_url(_redis_url(args))
    ledger.ping()
    return ledger


def cmd_submit(args: argparse.Namespace, console: Console) -> int:
    from producer.feeder import Unsettled
    from tokenfleet.submit import run_submit, settled_warnings

    cfg = load_config(args.config)
    try:
        snaps = run_submit(
            cfg,
            console,
            server_check=not args.no_server_check,
            window=args.window,
            stall_s=args.give_up_after,
            accept_change=args.accept_change,
            new_version=args.new_version,
        )
    except Unsettled as e:
        if e.snapshots:
            console.print(status_table(e.snapshots, title="not settled"))
        sys.stderr.write(f"submit stopped before every dataset settled: {e.reason}\n")
        for line in e.left():
            sys.stderr.write(f"  {line}\n")
        sys.stderr.write("nothing is lost: run the same command again to resume\n")
        return EXIT_INTERRUPTED if e.reason == "interrupted" else EXIT_UNSETTLED
    console.print(status_table(snaps, title="settled"))
    for line in settled_warnings(snaps, cfg.output_dir):
        _warn(line)
    return EXIT_OK


def cmd_status(args: argparse.Namespace, console: Console) -> int:
    from rich.live import Live

    from budget.server_board import ServerLedger
    from tokenfleet.redis_check import unprotected_warning
    from tokenfleet.status_detail import dataset_detail, last_failures
    from workers.sink import dataset_dir
    from workers.version import full_version

    ledger = _ledger(args)
    mine = full_version()
    unprotected = unprotected_warning(_redis_url(args))

    servers = ServerLedger(ledger.client)
    names: list[str] = list(dict.fromkeys(args.names))
    if names:
        known = ledger.datasets()
        unknown = [n for n in names if n not in known]
        if unknown:
            listed = ", ".join(known) if known else "none yet"
            missing = ", ".join(repr(n) for n in unknown)
            where = redact_url(_redis_url(args))
            _error(f"no dataset named {missing} in the ledger at {where}; known: {listed}")
            return EXIT_USAGE

    def snapshots() -> list[DatasetSnapshot]:
        return [ledger.snapshot(n) for n in (names or ledger.datasets())]

    def detail(name: str) -> RenderableType:
        spec = ledger.spec(name)
        try:
            folder = dataset_dir(str(spec.get("output_dir") or ""), name)
        except ValueError:
            folder = None
        snap = ledger.snapshot(name)
        return dataset_detail(
            snap,
            spec,
            ledger.failures(name),
            servers.status(),
            last_failures(folder) if folder is not None else [],
            ledger.pending_reasons(name) if snap.pending else None,
        )

    def view() -> RenderableType:
        if names and not args.all:
            return Group(*(detail(n) for n in names))
        snaps = snapshots()
        if not snaps:
            return f"no datasets in the ledger at {redact_url(_redis_url(args))}\n{LOST_LEDGER_HINT}"
        return fleet_view(snaps, ledger.workers(), mine, servers=servers.status())

    if args.json:
        body = {
            "datasets": [snapshot_json(s) for s in snapshots()],
            "workers": workers_json(ledger.workers(), mine),
            "servers": [s.as_dict() | {"url": redact_url(s.url)} for s in servers.status()],
            "version": mine,
            "warnings": [unprotected] if unprotected else [],
        }
        sys.stdout.write(orjson.dumps(body).decode() + "\n")
        return EXIT_OK
    if unprotected:
        console.print(f"[bold yellow]warning:[/] {escape(unprotected)}", soft_wrap=True)
    if args.watch and not console.is_terminal:
        # Into a pipe or a file (rich's Live would show nothing until the end): a view every interval.
        while True:
            console.print(view())
            console.print()
            console.file.flush()
            time.sleep(args.interval)
    elif args.watch:
        # Redrawn in place; each draw fits the terminal's width at that moment (resizing included).
        with Live(view(), console=console, refresh_per_second=4, screen=False) as live:
            while True:
                time.sleep(args.interval)
                live.update(view())
    else:
        console.print(view())
    return EXIT_OK


def cmd_export(args: argparse.Namespace, console: Console) -> int:
    from tokenfleet.export import ExportError, export_dataset, unsettled_warning

    ledger = _ledger(args)
    before = ledger.snapshot(args.name)  # read first: what is committed after it may be missing
    try:
        report = export_dataset(
            ledger,
            args.name,
            Path(args.output),
            args.output_dir,
            format=args.format,
            include_truncated=args.include_truncated,
        )
    except ExportError as e:
        _error(e)
        return EXIT_USAGE
    if warning := unsettled_warning(before, report.committed):
        _warn(warning)
    thinking = f", {report.reasoning_tokens:,} of them reasoning" if report.reasoning_tokens else ""
    console.print(
        f"exported {report.records:,} records ({report.tokens:,} completion tokens{thinking}) of {args.name} "
        f"to {report.path} as {report.format}"
    )
    if report.skipped_truncated:
        console.print(
            f"[yellow]left out {report.skipped_truncated:,} truncated sample(s) "
            "(--include-truncated writes them)[/]"
        )
    if report.skipped_no_conversation:
        console.print(
            f"[yellow]left out {report.skipped_no_conversation:,} sample(s) with no conversation to write "
            "(pre-tokenized prompts: export them with --format specforge-tokens or tokens)[/]"
        )
    if report.skipped_no_prompt_ids:
        console.print(
            f"[yellow]left out {report.skipped_no_prompt_ids:,} sample(s) whose prompt the server tokenized "
            "(their prompt ids are not known: give the dataset a tokenizer)[/]"
        )
    if report.skipped_empty:
        console.print(f"[yellow]left out {report.skipped_empty:,} sample(s) with no generated token[/]")
    if report.replies_left_out:
        console.print(
            f"[yellow]left out {report.replies_left_out:,} earlier repl(ies) whose exact prompt is not on "
            "record (the chat template rewrote them in later prompts)[/]"
        )
    if report.format in ("specforge", "sharegpt"):
        _print_text_losses(report, console)
    if report.torn_lines:
        console.print(f"[yellow]skipped {report.torn_lines} torn line(s) in the part files[/]")
    if report.missing:
        console.print(
            f"[red]{report.missing} committed sample(s) have no record in the part files "
            "(were output files moved or deleted?)[/]"
        )
        return EXIT_FAILED
    return EXIT_OK


def _print_text_losses(report: ExportReport, console: Console) -> None:
    """What a text export loses: replies a trainer tokenizes to other ids, rows without a system turn."""
    if not report.replies_checked:
        console.print(
            "[yellow]replies not checked against their ids (the dataset has no tokenizer): a trainer "
            "tokenizes this text again; --format specforge-tokens keeps the exact ids[/]"
        )
    elif report.mismatches:
        where = "; ".join(m.describe() for m in report.mismatch_examples[:5])
        console.print(
            f"[yellow]{report.mismatches:,} of {report.replies_checked:,} repl(ies) do not re-tokenize to "
            f"the generated ids with the dataset's tokenizer (e.g. {where}); all in {report.mismatch_path}. "
            "--format specforge-tokens keeps the exact ids[/]"
        )
    else:
        console.print(
            f"all {report.replies_checked:,} repl(ies) re-tokenize to the generated ids with the dataset's "
            "tokenizer"
        )
    if report.no_system_turn:
        console.print(
            f"[yellow]{report.no_system_turn:,} row(s) have no system turn (their prompt had none): a "
            "trainer may add its template's default system prompt to them (SpecForge does); "
            "--format specforge-tokens keeps the exact prompt[/]"
        )


def cmd_control(args: argparse.Namespace, console: Console) -> int:
    from tokenfleet.control import ACTIONS

    ledger = _ledger(args)
    state, purged = ACTIONS[args.command](ledger, args.name)
    dropped = f"; {purged:,} queued task(s) dropped" if purged else ""
    console.print(f"{args.name}: {state}{dropped}")
    _say_if_nothing_feeds(ledger, args.name)
    return EXIT_OK


def _say_if_nothing_feeds(ledger: Ledger, name: str) -> None:
    """After a resume or a raised limit: where no producer feeds the dataset, say that its samples wait for
    the next submit (the command changed the ledger; it feeds nothing itself)."""
    from tokenfleet.status_view import nothing_feeds

    if nothing_feeds(ledger.snapshot(name)):
        _warn(
            f"no submit is feeding {name} now: its samples wait for `tokenfleet submit CONFIG` "
            "(or `docker compose up producer`)"
        )


def cmd_reconcile(args: argparse.Namespace, console: Console) -> int:
    from tokenfleet.reconcile import reconcile_dataset
    from tokenfleet.submit import register

    if args.config:
        cfg = load_config(args.config)
        ledger = Ledger.from_url(cfg.redis_url)
        ledger.ping()
        register(cfg, ledger)  # a lost ledger gets its datasets, limits and spec back from the config
        targets = {ds.name: cfg.output_dir for ds in cfg.datasets}
    else:
        ledger = _ledger(args)
        specs = {n: ledger.spec(n) for n in (args.names or ledger.datasets())}
        targets = {n: Path(spec["output_dir"]) for n, spec in specs.items() if spec.get("output_dir")}
    names = args.names or sorted(targets)
    for name in names:
        if name not in targets:
            raise UnknownDataset(name)
        r = reconcile_dataset(ledger, name, targets[name])
        console.print(
            f"{name}: {r.samples:,} samples, {r.tokens:,} tokens ({r.truncated:,} truncated), "
            f"{r.failed:,} failed from the output files; the ledger had {r.samples_before:,} samples, "
            f"{r.tokens_before:,} tokens; {r.duplicates:,} second generations and {r.torn_lines:,} torn "
            f"lines skipped; state {r.state}"
        )
    return EXIT_OK


def cmd_budget(args: argparse.Namespace, console: Console) -> int:
    from tokenfleet.control import KEEP, LimitError, live_limit

    try:  # before the ledger is opened: a limit refused changes nothing
        tokens = live_limit(args.tokens, "tokens")
        max_samples = KEEP if args.max_samples is None else live_limit(args.max_samples, "--max-samples")
    except LimitError as e:
        _error(e)
        return EXIT_USAGE
    ledger = _ledger(args)
    state = ledger.set_limits(args.name, tokens, max_samples)
    console.print(f"{args.name}: {state}")
    _say_if_nothing_feeds(ledger, args.name)
    return EXIT_OK


#: Worker processes ``tokenfleet worker`` starts by default at most (one per core up to this): each
#: process runs its generations' streams in threads under one GIL.
MAX_AUTO_PROCESSES = 8


def worker_processes(requested: str) -> int:
    """``--processes``: a number, or "auto" (one per core, at most ``MAX_AUTO_PROCESSES``)."""
    if requested == "auto":
        return max(1, min(os.cpu_count() or 1, MAX_AUTO_PROCESSES))
    return int(requested)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child, before exec
    """Linux: the child gets SIGTERM when the ``tokenfleet worker`` that started it dies."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def cmd_worker(args: argparse.Namespace, console: Console) -> int:
    if args.redis_url:
        os.environ["TOKENFLEET_REDIS_URL"] = args.redis_url
    from workers.app import app
    from workers.messages import QUEUE_NAME

    name = args.name or f"tokenfleet-{os.getpid()}"
    processes = worker_processes(args.processes)
    threads = args.concurrency
    children: KeptProcesses | None = None
    if processes > 1:
        console.print(
            f"tokenfleet worker {name}: {processes} processes ({args.processes}: one per core, at most "
            f"{MAX_AUTO_PROCESSES}), each with {threads} task threads"
            if args.processes == "auto"
            else f"tokenfleet worker {name}: {processes} processes, each with {threads} task threads"
        )
        base = [sys.executable, "-m", "tokenfleet.cli", "worker", "--processes=1"]
        base += [f"--concurrency={args.concurrency}", f"--loglevel={args.loglevel}"]
        children = KeptProcesses(
            [[*base, f"--name={name}-{i}"] for i in range(1, processes)],
            lambda command: subprocess.Popen(command, preexec_fn=_die_with_parent),
            lambda line: console.print(f"tokenfleet worker {name}: {line}"),
        )
        children.start()
    argv = [
        "worker",
        "--pool=threads",
        f"--concurrency={threads}",
        "--events",
        f"--loglevel={args.loglevel}",
        f"--queues={QUEUE_NAME}",
        f"--hostname={name}@%h",
        "--without-gossip",
        "--without-mingle",
    ]
    try:
        app.worker_main(argv=argv)
    finally:
        if children is not None:  # a warm shutdown of each: its generations finish and commit
            children.stop(signal.SIGTERM)
    return EXIT_OK


def cmd_metrics(args: argparse.Namespace, console: Console) -> int:
    from tokenfleet.metrics import serve_metrics

    _ledger(args)  # a wrong URL is one clear line, not a scrape error later
    console.print(f"serving Prometheus metrics on http://{args.host}:{args.port}/metrics")
    serve_metrics(_redis_url(args), args.host, args.port)
    return EXIT_OK


def cmd_demo(args: argparse.Namespace, console: Console) -> int:
    from tokenfleet.demo import run_demo

    return run_demo(console, workdir=Path(args.workdir), redis_url=args.redis_url)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenfleet", description=__doc__)
    p.add_argument("--version", action="version", version=f"tokenfleet {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def with_redis(sp: argparse.ArgumentParser) -> argparse.ArgumentParser:
        sp.add_argument("--redis-url", help="the ledger's Redis (default: $TOKENFLEET_REDIS_URL or local)")
        return sp

    s = sub.add_parser("submit", help="validate, register and feed the datasets of CONFIG until settled")
    s.add_argument("config")
    s.add_argument("--no-server-check", action="store_true", help="skip the one-token probe of each server")
    s.add_argument(
        "--window",
        type=int,
        default=None,
        help="samples kept queued per dataset (default: 512, or what its servers run at once when more)",
    )
    s.add_argument(
        "--give-up-after",
        type=float,
        default=900.0,
        metavar="SECONDS",
        help="exit 3, saying what is left, after this long with no progress and no worker online "
        "(default 900; 0 waits for ever)",
    )
    change = s.add_mutually_exclusive_group()
    change.add_argument(
        "--accept-change",
        action="store_true",
        help="a dataset's settings or source changed since its first submit: go on, and record the change",
    )
    change.add_argument(
        "--new-version",
        action="store_true",
        help="a dataset changed: generate it afresh as NAME.vN, with its own ledger and output folder",
    )
    s.set_defaults(func=cmd_submit)

    s = with_redis(
        sub.add_parser(
            "status",
            help="per dataset: state, tokens, samples, rate, ETA, in flight, problems; NAME: one in full",
        )
    )
    s.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help="a dataset to show in full (limits, policy, outcomes, servers, failures by reason, last errors)",
    )
    s.add_argument("--all", action="store_true", help="with NAMEs: their rows in the fleet view instead")
    s.add_argument("--json", action="store_true", help="the same figures as JSON")
    s.add_argument("--watch", action="store_true", help="a live view, refreshed until Ctrl-C")
    s.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes of --watch")
    s.set_defaults(func=cmd_status)

    s = with_redis(sub.add_parser("export", help="write each committed sample of NAME once to a JSONL file"))
    s.add_argument("name")
    s.add_argument("-o", "--output", required=True)
    s.add_argument("--output-dir", type=Path, help="where the part files are, if not where workers wrote")
    s.add_argument(
        "--format",
        choices=EXPORT_FORMATS,
        default="tokens",
        help="tokens: full records with generated_mask (default); specforge-tokens: exact ids + loss_mask "
        "for SpecForge; speculators: vllm speculators regeneration rows; specforge / sharegpt: "
        "conversation text rows",
    )
    s.add_argument(
        "--include-truncated",
        action="store_true",
        help="all formats but tokens: also write samples cut at the token budget (tokens always does)",
    )
    s.set_defaults(func=cmd_export)

    for name, text in (
        ("pause", "start no new generation of NAME"),
        ("resume", "resume a paused or revoked dataset"),
        ("revoke", "stop NAME: drop its queued tasks, stop its generations"),
    ):
        s = with_redis(sub.add_parser(name, help=text))
        s.add_argument("name")
        s.set_defaults(func=cmd_control)

    s = with_redis(sub.add_parser("budget", help="change NAME's token budget (and sample cap) live"))
    s.add_argument("name")
    s.add_argument("tokens", help="the token budget: a number, '-' to leave it as it is, 'none' to remove it")
    s.add_argument("--max-samples", help="the sample cap: a number, or 'none' to remove it")
    s.set_defaults(func=cmd_budget)

    s = with_redis(sub.add_parser("reconcile", help="rebuild the ledger of datasets from their output files"))
    s.add_argument("names", nargs="*", help="datasets (default: all)")
    s.add_argument("--config", help="re-register the datasets of this config first (for a lost ledger)")
    s.set_defaults(func=cmd_reconcile)

    s = with_redis(sub.add_parser("worker", help="run a Celery worker sized for long generations"))
    s.add_argument(
        "--concurrency",
        type=int,
        default=DEFAULT_CONCURRENCY,
        help="task threads per process: each runs one task (a sample, or a group of samples_per_task) "
        "until its samples are recorded",
    )
    s.add_argument(
        "--processes",
        default="auto",
        type=lambda v: v if v == "auto" else str(max(1, int(v))),
        help="worker processes (default auto: one per core, at most 8)",
    )
    s.add_argument("--loglevel", default="INFO")
    s.add_argument("--name", help="the worker's name before @host (default tokenfleet-PID)")
    s.set_defaults(func=cmd_worker)

    # `tokenfleet sim ...` is handed to the simulator's own parser in main(); listed here for --help.
    sub.add_parser(
        "sim", help="serve the SGLang-compatible simulator (tokenfleet sim --help)", add_help=False
    )

    s = with_redis(sub.add_parser("metrics", help="serve datasets, servers and workers for Prometheus"))
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=9808)
    s.set_defaults(func=cmd_metrics)

    s = with_redis(sub.add_parser("demo", help="run a whole generation on this machine, no GPU needed"))
    s.add_argument(
        "--workdir", default="tokenfleet-demo", help="where the demo writes (default ./tokenfleet-demo)"
    )
    s.set_defaults(func=cmd_demo)
    return p


def _error(message: object) -> None:
    """One plain line on stderr (no markup, no wrapping: messages hold paths and brackets)."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


def _warn(message: object) -> None:
    """One plain line on stderr that does not stop the command (as ``_error``)."""
    sys.stderr.write(f"warning: {message}\n")
    sys.stderr.flush()


def main(argv: Sequence[str] | None = None) -> int:
    from producer.feeder import Unsettled
    from tokenfleet.submit import SubmitError

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sim"]:  # the simulator parses its own options (argparse REMAINDER cannot take "--x")
        from tokenfleet.sim import main as sim_main

        return sim_main(argv[1:])
    args = build_parser().parse_args(argv)
    # Without a terminal (logs, CI, pipes) keep tables wide enough to read instead of 80 columns.
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    try:
        if hasattr(args, "redis_url"):  # checked before any command runs: worker and demo hand it on unread
            _redis_url(args)
        return int(args.func(args, console))
    except (ConfigError, SourceError, LedgerError, SubmitError) as e:
        _error(e)
        if isinstance(e, UnknownDataset):
            sys.stderr.write(f"{LOST_LEDGER_HINT}\n")
    except Unsettled as e:
        sys.stderr.write(f"stopped before every dataset settled: {e.reason}\n")
        for line in e.left():
            sys.stderr.write(f"  {line}\n")
        return EXIT_INTERRUPTED if e.reason == "interrupted" else EXIT_UNSETTLED
    except KeyboardInterrupt:
        if args.func is cmd_status:  # it only reads: nothing to resume
            sys.stderr.write("interrupted\n")
        else:
            sys.stderr.write("interrupted: nothing is lost; run the same command again to resume\n")
        return EXIT_INTERRUPTED
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
