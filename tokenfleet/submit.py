"""``tokenfleet submit``: check everything a user can get wrong, register the datasets, feed the queue
until every dataset is settled.

Every check runs before anything is written to Redis or the queue: a mistake costs one clear line and
exit code 2, with nothing half-done.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from rich.console import Console, RenderableType
from rich.live import Live
from rich.markup import escape

from budget import DatasetLimits, DatasetSnapshot, Ledger
from budget.servers import ServerLedger
from producer.chat import ChatError
from producer.feeder import DEFAULT_WINDOW, DatasetFeed, Feeder
from producer.formats import CHAT_SHAPES
from producer.source import RecordReader, SourceError, SourceOptions, first_record
from tokenfleet.config import FleetConfig, redact_url
from tokenfleet.publish import TaskPublisher
from tokenfleet.reconcile import disagreement
from tokenfleet.server_facts import ServerFacts, learn, smallest
from tokenfleet.view import fleet_view
from workers.settings import QUEUE_NAME
from workers.sglang.auth import MissingKey, server_auth
from workers.sglang.client import SGLangClient, SGLangError, Unauthorized
from workers.version import full_version

#: The prompt of the one-token probe sent to each server at submit (any valid token ids do).
PROBE_INPUT_IDS: Final = [1, 2, 3]
#: How long a server may take to answer the probe.
PROBE_TIMEOUT_S: Final = 60.0
#: Without a terminal, how often to print a progress line.
PLAIN_PROGRESS_EVERY_S: Final = 10.0


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


def dataset_spec(
    cfg: FleetConfig, name: str, servers: Mapping[str, ServerFacts] | None = None
) -> dict[str, Any]:
    """What workers read from the ledger for each task of dataset ``name``. ``servers``: what submit
    learned of each server (asked now when not given)."""
    ds = next(d for d in cfg.datasets if d.name == name)
    if servers is None:
        servers = learn_servers(cfg)
    # Generations in flight per server, fleet-wide (workers.servers). Default: the server's batch size in
    # force, so requests wait in our queue rather than in the server's, where a stop could not reach them
    # before they are prefilled. A server that does not tell (down now, or an sglang-router, which has no
    # /server_info) gets no cap.
    caps: dict[str, int | None] = {
        url: cfg.server.max_inflight_per_server or (servers[url].batch_size if url in servers else None)
        for url in cfg.server.urls
    }
    return {
        "servers": list(cfg.server.urls),
        "max_inflight_per_server": caps,
        "timeout_s": cfg.server.timeout_s,
        "sampling": ds.sampling,
        "output_dir": str(cfg.output_dir),
        "on_budget": ds.on_budget,
        "fsync": cfg.fsync,
        "max_attempts": cfg.retry.max_attempts,
        "backoff_base_s": cfg.retry.backoff_base_s,
        "backoff_cap_s": cfg.retry.backoff_cap_s,
        # Workers render the prompts of a regenerate="all" conversation after its first reply.
        "tokenizer": ds.tokenizer,
        "regenerate": ds.regenerate,
        # Where each worker finds each server's API keys (names of variables or files, never keys).
        "auth": cfg.server.auth_refs(),
        # Workers refuse an out-of-vocabulary id too, as a last guard for the servers.
        "vocab_size": vocab_size(cfg, servers),
    }


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


def register(
    cfg: FleetConfig, ledger: Ledger, servers: Mapping[str, ServerFacts] | None = None
) -> dict[str, str]:
    if servers is None:
        servers = learn_servers(cfg)
    states = {}
    for ds in cfg.datasets:
        limits = DatasetLimits(ds.token_budget, ds.max_samples, ds.on_budget)
        states[ds.name] = ledger.register(ds.name, limits, dataset_spec(cfg, ds.name, servers))
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
    window: int = DEFAULT_WINDOW,
    observer: Callable[[list[DatasetSnapshot]], None] | None = None,
) -> list[DatasetSnapshot]:
    """Checks, registers and feeds; returns the settled snapshots. Raises SubmitError or LedgerError.
    ``observer`` sees every snapshot the progress display sees (benchmarks time state changes with it)."""
    Ledger.from_url(cfg.redis_url).ping()  # fail fast on a wrong URL, before anything is written
    ledger = Ledger.from_url(cfg.redis_url, patient=True)
    if server_check:
        with submit_client(cfg) as client:
            servers = check_servers(cfg, client)
    else:
        servers = learn_servers(cfg)
    vocab = vocab_size(cfg, servers)
    if vocab is None:
        console.print(
            "[yellow]warning:[/] the model's vocabulary size is unknown (no server names a model folder "
            "readable here): pre-tokenized ids are not checked, and an id outside the vocabulary crashes "
            "a real SGLang server; set \\[server] vocab_size"
        )
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
    warn_on_disagreement(cfg, ledger, console)
    states = register(cfg, ledger, servers)
    for name, state in states.items():
        if state in ("paused", "revoked"):
            console.print(f"[yellow]{name} is {state}: nothing is fed until `tokenfleet resume {name}`[/]")
    console.print(f"submitted {len(states)} dataset(s) to {redact_url(cfg.redis_url)}; waiting for workers")

    feeder = Feeder(
        ledger, TaskPublisher(app, cfg.samples_per_task), feeds, window=window, queue_key=QUEUE_NAME
    )

    def observed(show: Callable[[list[DatasetSnapshot]], None]) -> Callable[[list[DatasetSnapshot]], None]:
        def tick(snaps: list[DatasetSnapshot]) -> None:
            if observer is not None:
                observer(snaps)
            show(snaps)

        return tick

    tick_s = 0.05 if observer is not None else 0.5
    if console.is_terminal:
        mine = full_version()

        def view(snaps: list[DatasetSnapshot]) -> RenderableType:
            servers = ServerLedger(ledger.client).status()
            return fleet_view(snaps, ledger.workers(), mine, title="tokenfleet submit", servers=servers)

        with Live(view(feeder.snapshots()), console=console, refresh_per_second=4) as live:
            return feeder.run(on_tick=observed(lambda snaps: live.update(view(snaps))), tick_s=tick_s)
    last = [0.0]

    def plain(snaps: list[DatasetSnapshot]) -> None:
        if time.monotonic() - last[0] >= PLAIN_PROGRESS_EVERY_S:
            console.print(_plain_line(snaps))
            last[0] = time.monotonic()

    return feeder.run(on_tick=observed(plain), tick_s=tick_s)
