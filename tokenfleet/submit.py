"""``tokenfleet submit``: check everything a user can get wrong, register the datasets, feed the queue
until every dataset is settled.

Every check runs before anything is written to Redis or the queue: a mistake costs one clear line and
exit code 2, with nothing half-done.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from rich.console import Console, RenderableType
from rich.live import Live
from rich.markup import escape

from budget import DatasetLimits, DatasetSnapshot, DatasetState, Ledger, LedgerError
from budget.server_board import ServerLedger
from budget.spec import DatasetSpec
from budget.storage import (
    EPOCH_MARKER,
    ensure_storage_marker,
    new_token,
    probe_writable,
    read_marker,
    write_marker,
)
from chat.templates import ChatError
from producer.feeder import DEFAULT_STALL_S, DEFAULT_WINDOW, DatasetFeed, Feeder, Unsettled
from producer.formats import CHAT_SHAPES
from producer.source import RecordReader, SourceError, SourceOptions, first_record
from tokenfleet.config import DatasetConfig, FleetConfig, redact_url
from tokenfleet.fingerprint import (
    compare_sources,
    decode,
    encode,
    settings_changes,
    settings_of,
    source_fingerprint,
)
from tokenfleet.publish import GroupSizer, TaskPublisher
from tokenfleet.reconcile import count_part_lines, disagreement, reconcile_dataset
from tokenfleet.redis_check import unprotected_warning
from tokenfleet.server_facts import ServerFacts, learn, smallest, vocab_unknown_warning
from tokenfleet.status_view import fleet_view
from workers.messages import QUEUE_NAME
from workers.sglang.auth import MissingKey, server_auth
from workers.sglang.client import SGLangClient, SGLangError, Unauthorized
from workers.version import full_version

#: The prompt of the one-token probe sent to each server at submit (any valid token ids do).
PROBE_INPUT_IDS: Final = [1, 2, 3]
#: How long a server may take to answer the probe.
PROBE_TIMEOUT_S: Final = 60.0
#: Without a terminal, how often to print a progress line.
PLAIN_PROGRESS_EVERY_S: Final = 10.0
#: When the ledger vanishes mid-run, wait this long before rebuilding it from the output files: a worker
#: that finished a generation as Redis went away writes its record first (its commit then fails), and
#: every other generation stops at its next chunk (its lease is gone).
LOST_LEDGER_GRACE_S: Final = 2.0
#: What submit calls each limit the ledger may keep at its value set live.
LIMIT_NAMES: Final = {"token_budget": "token budget", "max_samples": "sample cap"}


class SubmitError(Exception):
    """A user-facing problem found before anything was enqueued (exit code 2)."""


def submit_client(cfg: FleetConfig) -> SGLangClient:
    """A client for submit's checks, holding each server's API keys from this process's environment or
    secret files. Raises SubmitError when a key is missing here."""
    client = SGLangClient(max_connections=4)
    for url, refs in cfg.server.auth_refs().items():
        try:
            client.set_auth(url, server_auth(refs))
        except MissingKey as e:
            client.close()
            raise SubmitError(f"{cfg.source_path}: server {redact_url(url)}: API key: {e}") from None
    return client


def learn_servers(cfg: FleetConfig) -> dict[str, ServerFacts]:
    """What each server tells (a server that does not answer tells nothing)."""
    facts = {}
    with submit_client(cfg) as client:
        for url in cfg.server.urls:
            try:
                facts[url] = learn(client, url)
            except (SGLangError, ValueError):
                facts[url] = ServerFacts(url)
    return facts


def server_caps(cfg: FleetConfig, servers: Mapping[str, ServerFacts]) -> dict[str, int | None]:
    """Generations in flight per server, fleet-wide (workers.server_picker). Default: the batch size in
    force, so requests wait in our queue rather than in the server's, where a stop could not reach them
    before they are prefilled. A server that does not tell (down now, or an sglang-router, which has no
    /server_info) gets no cap."""
    return {
        url: cfg.server.max_inflight_per_server or (servers[url].batch_size if url in servers else None)
        for url in cfg.server.urls
    }


def wanted_inflight(cfg: FleetConfig, servers: Mapping[str, ServerFacts]) -> int | None:
    """Generations the servers can run at once (their caps' sum), or None when one has no cap."""
    caps = server_caps(cfg, servers).values()
    return None if any(c is None for c in caps) else sum(c for c in caps if c is not None)


def queue_window(wanted: int | None) -> int:
    """Samples kept queued per dataset by default: ``DEFAULT_WINDOW``, or what the servers run at once
    (``wanted``) when that is more. For fleets of many servers: eight of 1,024 would get a sixteenth of
    their batch per feeder round from a window of 512, about 5,000 samples a second at 0.1 s rounds.
    (With one server of 1,024 the ramp measured the same either way: 1,000 running 1.3-2.2 s after
    submit's start.)"""
    return max(DEFAULT_WINDOW, wanted or 0)


def dataset_spec(
    cfg: FleetConfig,
    name: str,
    servers: Mapping[str, ServerFacts] | None = None,
    storage_token: str | None = None,
) -> DatasetSpec:
    """What workers read from the ledger for each task of dataset ``name``. ``servers``: what submit
    learned of each server (asked now when not given); ``storage_token``: the token of submit's storage
    marker in ``output_dir``."""
    ds = next(d for d in cfg.datasets if d.name == name)
    if servers is None:
        servers = learn_servers(cfg)
    caps = server_caps(cfg, servers)
    return DatasetSpec(
        servers=tuple(cfg.server.urls),
        output_dir=str(cfg.output_dir),
        sampling=ds.sampling,
        max_inflight_per_server=caps,
        timeout_s=cfg.server.timeout_s,
        stall_timeout_s=cfg.server.stall_timeout_s,
        on_budget=ds.on_budget,
        fsync=cfg.fsync,
        max_attempts=cfg.retry.max_attempts,
        backoff_base_s=cfg.retry.backoff_base_s,
        backoff_cap_s=cfg.retry.backoff_cap_s,
        retry_min_span_s=cfg.retry.min_span_s,
        tokenizer=ds.tokenizer,
        regenerate=ds.regenerate,
        auth=cfg.server.auth_refs(),
        vocab_size=vocab_size(cfg, servers),
        storage_token=storage_token,
    )


def vocab_size(cfg: FleetConfig, servers: Mapping[str, ServerFacts]) -> int | None:
    """The config's ``vocab_size``, else the smallest the servers' model folders give."""
    return cfg.server.vocab_size or smallest([f.vocab_size for f in servers.values()])


def check_servers(cfg: FleetConfig, client: SGLangClient) -> dict[str, ServerFacts]:
    """Each server answers ``/server_info``, accepts each dataset's sampling params and returns
    ``output_ids``: one tiny generation per dataset and server, so a 0.4 server, a rejected key or a
    missing API key is caught here instead of on every task. Returns what each server told."""
    facts = {}
    for url in cfg.server.urls:
        try:
            info = client.server_info(url)
        except SGLangError as e:
            raise SubmitError(
                f"server {redact_url(url)} does not answer: {e.message} (start it, or pass --no-server-check)"
            ) from None
        for ds in cfg.datasets:
            probe = dict(ds.sampling) | {"max_new_tokens": 1}
            try:
                client.generate(
                    url,
                    rid=f"tokenfleet-probe-{time.time_ns()}",
                    sampling_params=probe,
                    input_ids=PROBE_INPUT_IDS,
                    timeout_s=PROBE_TIMEOUT_S,
                )
            except Unauthorized as e:
                raise SubmitError(
                    f"{cfg.source_path}: server {redact_url(url)} refused our API key ({e.message}): set "
                    "[server] api_key_env or api_key_file to where its --api-key is"
                ) from None
            except SGLangError as e:
                raise SubmitError(
                    f'{cfg.source_path}: dataset "{ds.name}": server {redact_url(url)} refused its sampling '
                    f"params: {e.message}"
                ) from None
        facts[url] = learn(client, url, info)
    return facts


@dataclass(frozen=True)
class Registered:
    """One dataset as ``Ledger.register`` left it: its state, and the limits it kept at their values set
    live with ``tokenfleet budget`` instead of the config's (None: removed live)."""

    state: str
    kept: dict[str, int | None] = field(default_factory=dict)


def register(
    cfg: FleetConfig,
    ledger: Ledger,
    storage_token: str | None = None,
    servers: Mapping[str, ServerFacts] | None = None,
) -> dict[str, Registered]:
    """Register (or update) every dataset of ``cfg``; ``storage_token`` goes into each spec, for workers
    to check they write to the storage submit marked (`budget.storage.check_same_storage`). ``servers``:
    what submit learned of each server (asked now when not given)."""
    if servers is None:
        servers = learn_servers(cfg)
    registered = {}
    for ds in cfg.datasets:
        limits = DatasetLimits(ds.token_budget, ds.max_samples, ds.on_budget)
        spec = dataset_spec(cfg, ds.name, servers, storage_token)
        registered[ds.name] = Registered(*ledger.register(ds.name, limits, spec.as_json()))
    return registered


def kept_limit_lines(ds: DatasetConfig, kept: Mapping[str, int | None]) -> list[str]:
    """One line per limit the ledger kept at its value set live rather than ``ds``'s: a submit run again
    must not undo a live change silently, nor keep it without saying so."""

    def shown(value: int | None) -> str:
        return "none" if value is None else f"{value:,}"

    return [
        f"{ds.name}: keeping the {LIMIT_NAMES[limit]} set live ({shown(value)}); the config says "
        f"{shown(getattr(ds, limit))} — change it with `tokenfleet budget {ds.name}` or edit the config"
        for limit, value in kept.items()
    ]


@dataclass
class Identity:
    """What submit found about the datasets before writing anything (`check_identity`)."""

    cfg: FleetConfig
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    sources: dict[str, bytes] = field(default_factory=dict)
    #: Datasets whose recorded settings and source fingerprint are replaced by this submit's.
    record: set[str] = field(default_factory=set)
    #: New version name -> the dataset it is a version of.
    versions: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def check_output_dir(cfg: FleetConfig) -> None:
    """``output_dir`` and each dataset's folder take a new file (a probe, removed at once)."""
    for folder in [cfg.output_dir, *(cfg.output_dir / ds.name for ds in cfg.datasets)]:
        problem = probe_writable(folder)
        if problem:
            raise SubmitError(f"{cfg.source_path}: output_dir is not writable: {problem}")


def persistence_warning(ledger: Ledger) -> str | None:
    """A warning when Redis keeps no append-only file (a restart then loses the ledger's recent changes,
    or all of it); None when it does, or when Redis forbids CONFIG."""
    found = ledger.persistence()
    if found is None or found.get("appendonly", "no") == "yes":
        return None
    snapshots = "with RDB snapshots only" if found.get("save") else "with no persistence at all"
    return (
        f"Redis runs {snapshots} (appendonly no): a restart loses the ledger. submit rebuilds it from the "
        "output files, but set appendonly yes (with appendfsync everysec) to keep it"
    )


def _next_version(ledger: Ledger, base: str, current: str, known: set[str]) -> str:
    k = int(current.rsplit(".v", 1)[1]) + 1 if current != base and ".v" in current else 2
    while f"{base}.v{k}" in known:
        k += 1
    return f"{base}.v{k}"


def check_identity(
    cfg: FleetConfig, ledger: Ledger, *, accept_change: bool = False, new_version: bool = False
) -> Identity:
    """Fingerprint each dataset's settings and source and compare them with its first submit's. A change
    is a SubmitError naming it, unless ``accept_change`` (record the new fingerprints) or ``new_version``
    (feed it as ``NAME.vN``, a dataset of its own with its own output folder). Writes nothing."""
    known = set(ledger.datasets())
    out = Identity(cfg)
    datasets: list[DatasetConfig] = []
    for ds in cfg.datasets:
        base = ds.name
        current = ledger.identity(base).get("current", base) if base in known else base
        mine = ledger.identity(current) if current in known else {}
        settings = settings_of(ds)
        try:
            source = source_fingerprint(ds.path, ds.id_field)
        except SourceError as e:
            raise SubmitError(f'{cfg.source_path}: dataset "{base}": {e}') from None
        old_settings = json.loads(mine["settings"]) if mine.get("settings") else None
        old_source = ledger.source_digest(current) if current in known else None
        changes = settings_changes(old_settings, settings) if old_settings is not None else []
        src = compare_sources(decode(old_source), source) if old_source else None
        if src is not None and src.rewrites:
            changes.append(f"source {ds.path}: {src.describe()}")
        name = current
        if changes:
            shown = f'dataset "{base}"' + (f" (version {current})" if current != base else "")
            what = "; ".join(changes)
            if new_version:
                name = _next_version(ledger, base, current, known)
                out.versions[name] = base
                out.notes.append(f"{shown} changed ({what}): fed as a new version, {name}")
            elif accept_change:
                out.notes.append(f"{shown} changed ({what}): going on as told (--accept-change)")
            else:
                raise SubmitError(
                    f"{cfg.source_path}: {shown} changed since its first submit: {what}. Its samples would "
                    "mix the old and the new; pass --accept-change to go on and record the change, or "
                    f"--new-version to generate it afresh as {_next_version(ledger, base, current, known)} "
                    "in its own output folder"
                )
        elif src is not None and src.added:
            out.notes.append(f'dataset "{name}": {src.added:,} new source line(s)')
        if old_settings is None or old_source is None or changes or (src is not None and src.added):
            out.record.add(name)
        out.settings[name] = settings
        out.sources[name] = source
        datasets.append(ds if name == base else ds.model_copy(update={"name": name}))
        # The output folder must belong to this ledger (or to none).
        marker = read_marker(cfg.output_dir / name / EPOCH_MARKER)
        epoch = ledger.identity(name).get("epoch") if name in known else None
        if marker and epoch and marker != epoch:
            raise SubmitError(
                f"{cfg.output_dir / name}: its epoch marker ({EPOCH_MARKER}) is not this ledger's: the "
                "folder was written for another Redis; use another output_dir (or remove the marker if this "
                "ledger is the right one)"
            )
    out.cfg = cfg.model_copy(update={"datasets": datasets})
    return out


def adopt_outputs(
    cfg: FleetConfig,
    ledger: Ledger,
    console: Console,
    identity: Identity,
    storage_token: str,
    *,
    only: set[str] | None = None,
    servers: Mapping[str, ServerFacts] | None = None,
) -> dict[str, str]:
    """Register the datasets; first rebuild from the output files any whose ledger vanished (an epoch
    marker or part files, and a ledger that does not know it); then record epochs, fingerprints and
    markers; say which limits the ledger kept at their values set live. ``only``: just these datasets
    (the ones lost mid-run). Returns the datasets' states."""
    known = set(ledger.datasets())
    lost = {
        ds.name
        for ds in cfg.datasets
        if ds.name not in known
        and (
            read_marker(cfg.output_dir / ds.name / EPOCH_MARKER) is not None
            or count_part_lines(cfg.output_dir / ds.name) > 0
        )
    }
    registered = register(cfg, ledger, storage_token, servers)
    states = {name: r.state for name, r in registered.items()}
    for ds in cfg.datasets:
        name = ds.name
        if only is not None and name not in only:
            continue
        for line in kept_limit_lines(ds, registered[name].kept):
            console.print(f"[yellow]{escape(line)}[/]", soft_wrap=True)
        if name in lost:
            r = reconcile_dataset(ledger, name, cfg.output_dir)
            states[name] = r.state
            console.print(
                f"[bold yellow]{escape(name)}: the ledger had lost this dataset (Redis restarted without "
                f"persistence, or flushed): rebuilt from the output files: {r.samples:,} samples, "
                f"{r.tokens:,} tokens, {r.failed:,} failed; none of them is generated again[/]",
                soft_wrap=True,
            )
        marker_path = cfg.output_dir / name / EPOCH_MARKER
        epoch = read_marker(marker_path) or ledger.identity(name).get("epoch") or new_token()
        fields = {"epoch": epoch, "storage_token": storage_token}
        if name in identity.record or name in lost:
            fields["settings"] = json.dumps(identity.settings[name], sort_keys=True)
            ledger.set_source_digest(name, encode(identity.sources[name]))
        if name in identity.versions:
            fields["version_of"] = identity.versions[name]
            ledger.set_identity(identity.versions[name], current=name)
        ledger.set_identity(name, **fields)
        if read_marker(marker_path) != epoch:
            write_marker(marker_path, epoch)
    return states


def warn_on_disagreement(cfg: FleetConfig, ledger: Ledger, console: Console) -> None:
    known = set(ledger.datasets())
    for ds in cfg.datasets:
        samples = ledger.snapshot(ds.name).samples if ds.name in known else 0
        problem = disagreement(samples, cfg.output_dir / ds.name)
        if problem:
            console.print(f"[bold red]warning:[/] {escape(ds.name)}: {escape(problem)}")


def feeds_for(
    cfg: FleetConfig,
    context_length: int | None = None,
    *,
    max_input_len: int | None = None,
    vocab_size: int | None = None,
) -> list[DatasetFeed]:
    """One feed per dataset, reading its records with its format, tokenizer and what the servers take
    (context length, longest prompt, vocabulary). Loads each tokenizer and reads each source's first
    record now: a chat dataset without a usable tokenizer is a SubmitError before anything is
    registered."""
    feeds = []
    for ds in cfg.datasets:
        where = f'{cfg.source_path}: dataset "{ds.name}"'
        options = SourceOptions(
            format=ds.format,
            id_field=ds.id_field,
            regenerate=ds.regenerate,
            system_prompt=ds.system_prompt,
            tokenizer=ds.tokenizer,
            context_length=context_length,
            max_new_tokens=ds.sampling.get("max_new_tokens"),
            max_input_len=max_input_len,
            vocab_size=vocab_size,
        )
        try:
            reader = RecordReader(options)
            first = first_record(ds.path, ds.format, ds.id_field)
        except (ChatError, SourceError) as e:
            raise SubmitError(f"{where}: {e}") from None
        if first is not None and first[1] in CHAT_SHAPES and reader.chat is None:
            raise SubmitError(
                f"{where}: line {first[0]} is a {first[1]} record: chat records are written with the target "
                "model's chat template, set tokenizer = <its local folder>"
            )
        rejected = cfg.output_dir / ds.name / "rejected.jsonl"
        feeds.append(DatasetFeed(ds.name, ds.path, rejected, reader=reader))
    return feeds


def _plain_line(snaps: Sequence[DatasetSnapshot]) -> str:
    parts = []
    for s in snaps:
        budget = f"/{s.token_budget}" if s.token_budget else ""
        parts.append(
            f"{s.name}: {s.state} {s.tokens}{budget} tok, {s.samples} samples, {s.inflight} in flight"
        )
    return "; ".join(parts)


def run_submit(
    cfg: FleetConfig,
    console: Console,
    *,
    server_check: bool = True,
    window: int | None = None,
    observer: Callable[[list[DatasetSnapshot]], None] | None = None,
    stall_s: float = DEFAULT_STALL_S,
    accept_change: bool = False,
    new_version: bool = False,
) -> list[DatasetSnapshot]:
    """Checks, registers and feeds; returns the snapshots once every dataset is settled in the ledger.
    Raises SubmitError or LedgerError, or `Unsettled` (with what is left) on Ctrl-C or after ``stall_s``
    with no progress and no worker online. ``observer`` sees every snapshot the progress display sees
    (benchmarks time state changes with it)."""
    Ledger.from_url(cfg.redis_url).ping()  # fail fast on a wrong URL, before anything is written
    ledger = Ledger.from_url(cfg.redis_url, patient=True)
    if server_check:
        with submit_client(cfg) as client:
            servers = check_servers(cfg, client)
    else:
        servers = learn_servers(cfg)
    warnings: list[str] = []
    unprotected = unprotected_warning(cfg.redis_url)
    if unprotected:
        warnings.append(unprotected)
    vocab = vocab_size(cfg, servers)
    if vocab is None:
        warnings.append(vocab_unknown_warning(servers, str(cfg.source_path)))
    for line in warnings:
        console.print(f"[bold yellow]warning:[/] {escape(line)}", soft_wrap=True)
    check_output_dir(cfg)
    identity = check_identity(cfg, ledger, accept_change=accept_change, new_version=new_version)
    cfg = identity.cfg  # a --new-version dataset is fed under its version's name
    # Without the server check, prompts are not held against the servers' limits (they fail on the
    # server, with its message); ids outside the vocabulary are always refused: they crash a server.
    feeds = feeds_for(  # loads the tokenizers: before anything is registered
        cfg,
        smallest([f.context_length for f in servers.values()]) if server_check else None,
        max_input_len=smallest([f.max_input_len for f in servers.values()]) if server_check else None,
        vocab_size=vocab,
    )

    from workers.app import make_app

    app = make_app(cfg.redis_url)
    warning = persistence_warning(ledger)
    if warning:
        console.print(f"[bold yellow]warning:[/] {escape(warning)}", soft_wrap=True)
    for note in identity.notes:
        console.print(f"[yellow]{escape(note)}[/]", soft_wrap=True)
    storage_token = ensure_storage_marker(cfg.output_dir)
    states = adopt_outputs(cfg, ledger, console, identity, storage_token, servers=servers)
    warn_on_disagreement(cfg, ledger, console)
    for name, state in states.items():
        if state in ("paused", "revoked"):
            console.print(f"[yellow]{name} is {state}: nothing is fed until `tokenfleet resume {name}`[/]")
    console.print(f"submitted {len(states)} dataset(s) to {redact_url(cfg.redis_url)}; waiting for workers")

    inflight = wanted_inflight(cfg, servers)
    rates: dict[str, float] = {}  # answers a second per dataset, from the feeder's last round
    sizer = GroupSizer(
        dict.fromkeys((ds.name for ds in cfg.datasets), inflight),
        say=lambda line: console.print(escape(line), soft_wrap=True),
        task_threads=lambda: sum(int(w.get("concurrency") or 0) for w in ledger.workers()),
        rate=lambda name: rates.get(name, 0.0),
    )
    if window is None:
        window = queue_window(inflight)
        if window > DEFAULT_WINDOW:
            console.print(f"{window:,} samples kept queued per dataset (what its servers run at once)")
    feeder = Feeder(
        ledger, TaskPublisher(app, cfg.samples_per_task, sizer), feeds, window=window, queue_key=QUEUE_NAME
    )

    def on_lost_ledger() -> None:
        time.sleep(LOST_LEDGER_GRACE_S)
        known = set(ledger.datasets())
        missing = {ds.name for ds in cfg.datasets if ds.name not in known}
        console.print(
            f"[bold red]the ledger vanished mid-run[/] ({', '.join(sorted(missing)) or 'no dataset'} "
            "missing): Redis restarted without persistence, or was flushed; rebuilding it"
        )
        adopt_outputs(cfg, ledger, console, identity, storage_token, only=missing, servers=servers)
        # The broker's queue and routing went with it: publish through a new connection.
        feeder.publish = TaskPublisher(make_app(cfg.redis_url), cfg.samples_per_task, sizer)

    def observed(show: Callable[[list[DatasetSnapshot]], None]) -> Callable[[list[DatasetSnapshot]], None]:
        def tick(snaps: list[DatasetSnapshot]) -> None:
            rates.update((s.name, s.samples_per_s) for s in snaps)
            if observer is not None:
                observer(snaps)
            show(snaps)

        return tick

    tick_s = 0.05 if observer is not None else 0.5
    try:
        snaps = _feed_until_settled(feeder, ledger, console, observed, tick_s, stall_s, on_lost_ledger)
    except KeyboardInterrupt:
        try:
            snaps = feeder.snapshots()
        except LedgerError:
            snaps = []
        raise Unsettled("interrupted", snaps) from None
    finally:
        # Again below the progress display, where the user looks once it ends.
        for line in closing_warnings(warnings, feeds):
            console.print(f"[bold yellow]warning:[/] {escape(line)}", soft_wrap=True)
    if not all(s.settled for s in snaps):  # the ledger has the last word, never the feeder's guess
        raise Unsettled("the feeder stopped before the ledger settled", snaps)
    return snaps


def settled_warnings(snaps: Sequence[DatasetSnapshot], output_dir: Path) -> list[str]:
    """What a settled run left out, one line per dataset and kind. Exit 0 says every sample has an end;
    these say which ends were not a record (failed samples, rejected source lines, nothing generated),
    so that a run that produced nothing does not pass for a good one."""
    out = []
    for s in snaps:
        if s.failed:
            out.append(f"{s.name}: {s.failed:,} sample(s) failed; `tokenfleet status {s.name}` says why")
        if s.rejected:
            where = output_dir / s.name / "rejected.jsonl"
            out.append(f"{s.name}: {s.rejected:,} source line(s) rejected, each with its reason in {where}")
        if not s.samples and s.state != DatasetState.REVOKED:
            out.append(f"{s.name}: no sample was generated")
    return out


def closing_warnings(warnings: Sequence[str], feeds: Sequence[DatasetFeed]) -> list[str]:
    """The start's warnings, with how many pre-tokenized prompts went unchecked against the vocabulary."""
    unchecked = sum(f.reader.unchecked for f in feeds if f.reader is not None)
    out = []
    for line in warnings:
        if "vocabulary size is unknown" in line and unchecked:
            line = f"{unchecked:,} prompt(s) sent with their ids unchecked: {line}"
        out.append(line)
    return out


def _feed_until_settled(
    feeder: Feeder,
    ledger: Ledger,
    console: Console,
    observed: Callable[[Callable[[list[DatasetSnapshot]], None]], Callable[[list[DatasetSnapshot]], None]],
    tick_s: float,
    stall_s: float,
    on_lost_ledger: Callable[[], None],
) -> list[DatasetSnapshot]:
    if console.is_terminal:
        mine = full_version()

        def view(snaps: list[DatasetSnapshot]) -> RenderableType:
            servers = ServerLedger(ledger.client).status()
            return fleet_view(snaps, ledger.workers(), mine, title="tokenfleet submit", servers=servers)

        with Live(view(feeder.snapshots()), console=console, refresh_per_second=4) as live:
            return feeder.run(
                on_tick=observed(lambda snaps: live.update(view(snaps))),
                tick_s=tick_s,
                stall_s=stall_s,
                on_lost_ledger=on_lost_ledger,
            )
    last = [0.0]

    def plain(snaps: list[DatasetSnapshot]) -> None:
        if time.monotonic() - last[0] >= PLAIN_PROGRESS_EVERY_S:
            console.print(_plain_line(snaps))
            last[0] = time.monotonic()

    return feeder.run(on_tick=observed(plain), tick_s=tick_s, stall_s=stall_s, on_lost_ledger=on_lost_ledger)
