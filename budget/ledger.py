"""Typed access to the dataset ledger. Every write is one Lua script (see ``budget/lua``)."""

from __future__ import annotations

import enum
import functools
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, ParamSpec, TypeVar

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from budget import defaults
from budget.errors import LedgerUnavailable, UnknownDataset
from budget.keys import DATASETS_SET, STOPS_CHANNEL, WORKERS_HASH, DatasetKeys, dataset_keys
from budget.lengths import bucket_of, parse_histogram, percentile
from budget.scripts import dataset_script_keys, register_scripts

#: How long a generation's lease lives without renewal. A worker renews it every few seconds; a killed
#: worker's samples are reclaimed this long after its last renewal.
DEFAULT_LEASE_MS: Final = int(defaults.LEASE_S * 1000)

#: A sample queued this long whose message is no longer in the broker's queue is taken as lost. A live
#: worker admits a message within moments of taking it (it prefetches no more than its threads), so a
#: mark this old is a worker killed between taking and admitting; a wrong guess only feeds a duplicate
#: that its second delivery drops.
DEFAULT_QUEUED_AUDIT_MS: Final = 30_000

#: A worker whose last heartbeat is older than this is not listed as online.
WORKER_SEEN_WITHIN_S: Final = 30.0

#: Rates in snapshots are averaged over this many seconds.
RATE_WINDOW_S: Final = 30

#: Connections one client's pool may open (a worker's generation threads, its keeper, flusher, watchers).
MAX_CONNECTIONS: Final = 1024

#: Retries of a patient client's command on connection errors (backoff capped at 2 s: about 30 s).
PATIENT_RETRIES: Final = 16

#: Fields of a dataset's identity hash: ``epoch`` (its output folder's epoch marker), ``storage_token``
#: (the output dir's storage marker), ``settings`` (JSON of its generation settings at the first submit),
#: ``version_of`` (a ``--new-version`` copy: the dataset it is a version of), ``current`` (on the first
#: version: the name of the version submit feeds now).
IDENTITY_FIELDS: Final = ("epoch", "storage_token", "settings", "version_of", "current")

#: ``enqueue`` codes (see ``budget/lua/enqueue.lua``).
ENQUEUE_PUBLISH: Final = 1
ENQUEUE_SKIP: Final = 0
ENQUEUE_WINDOW_FULL: Final = -1
ENQUEUE_NOT_ACTIVE: Final = -2
ENQUEUE_BUDGET_IN_FLIGHT: Final = -3
#: Sample ids per ``enqueue`` script call at most.
ENQUEUE_CHUNK: Final = 1000

P = ParamSpec("P")
R = TypeVar("R")


class DatasetState(enum.StrEnum):
    ACTIVE = "active"
    PAUSED = "paused"
    EXHAUSTED = "exhausted"
    REVOKED = "revoked"


class Admission(enum.StrEnum):
    """A worker's answer from ``admit``."""

    OK = "ok"
    DONE = "done"
    FAILED = "failed"
    LEASED = "leased"
    PAUSED = "paused"
    REVOKED = "revoked"
    EXHAUSTED = "exhausted"
    LIMIT = "limit"
    UNKNOWN = "unknown"


class Progress(enum.StrEnum):
    CONTINUE = "continue"
    STOP = "stop"
    LOST = "lost"


#: Why a limit stops what runs, in place of the state beside ``Progress.STOP`` (``progress.lua``) and as a
#: ``stop_reasons`` reason: the token budget, or the sample cap (reached, so nothing running can be kept).
STOP_BUDGET = "budget"
STOP_MAX_SAMPLES = "max_samples"


class FailOutcome(enum.StrEnum):
    """What ``fail`` did (``budget/lua/fail.lua``)."""

    FAILED = "failed"
    #: Another attempt had already committed the sample: nothing changed.
    DUPLICATE = "duplicate"
    UNKNOWN = "unknown"


class GiveUpOutcome(enum.StrEnum):
    """What ``give_up`` did (``budget/lua/give_up.lua``)."""

    #: Back to pending, to be fed again.
    PENDING = "pending"
    #: Failed for good after ``max_strikes`` give-ups.
    FAILED = "failed"
    DUPLICATE = "duplicate"
    UNKNOWN = "unknown"


class ReleaseOutcome(enum.StrEnum):
    """The dataset's state after ``release`` gave a sample back (``budget/lua/release.lua``)."""

    ACTIVE = "active"
    PAUSED = "paused"
    EXHAUSTED = "exhausted"
    REVOKED = "revoked"
    UNKNOWN = "unknown"


class HoldOutcome(enum.StrEnum):
    """What ``hold`` did (``budget/lua/hold.lua``)."""

    HELD = "held"
    #: The dataset's held records take the most they may: the sample must be given back.
    FULL = "full"
    LOST = "lost"
    DUPLICATE = "duplicate"
    UNKNOWN = "unknown"


class CommitOutcome(enum.StrEnum):
    COMMITTED = "committed"
    DUPLICATE = "duplicate"
    OVER_LIMIT = "over_limit"
    REVOKED = "revoked"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class Renewal:
    """What ``renew_report`` did: per lease, whether it is still held; and whether the dataset wants its
    live tokens reported again within a second (a discard budget while fewer answers are committed than
    run reads them to admit: ``live_wanted_soon`` in ``budget/lua/_lib.lua``)."""

    held: list[bool]
    soon: bool


@dataclass(frozen=True, slots=True)
class DatasetLimits:
    token_budget: int | None = None
    max_samples: int | None = None
    on_budget: str = defaults.ON_BUDGET


#: ``AdmitResult.cap`` of a generation under a truncate budget: its grant comes when it has a server slot
#: (``Ledger.grant_many``, ``GrantKind.START``).
GRANT_AT_SEND: Final = -1
#: What ``grant_many`` answers a start that gets no grant: none may start now (the dataset is not active:
#: the worker gives the sample back), ask again in a moment (the budget is all granted to running
#: generations that will give some back as they end), or the budget's end has come and the ledger has
#: already given the sample back (pending, reason ``limit``; the attempt's lease is gone).
GRANT_NOT_NOW: Final = -1
GRANT_WAIT: Final = -2
GRANT_DROPPED: Final = -3


@dataclass(frozen=True, slots=True)
class AdmitResult:
    admission: Admission
    state: str
    spec: dict[str, Any] | None
    #: Under a token budget: discard, the tokens reserved for this generation, the most it may produce
    #: (send ``max_new_tokens`` at most this); truncate, ``GRANT_AT_SEND``. 0: no reservation.
    cap: int = 0


class GrantKind(enum.StrEnum):
    START = "start"
    #: A start of a generation that cannot be continued past a grant (a text prompt on a server that cannot
    #: tokenize it).
    WHOLE = "whole"
    MORE = "more"
    END = "end"


@dataclass(frozen=True, slots=True)
class GrantAsk:
    """One ask of ``grant_many``: ``kind`` START with ``value`` its want, MORE with ``value`` the most it
    may still produce, END with ``value`` the tokens it produced in all. (The dataset's speed is the
    ledger's own measure, from when the asks come: ``budget/lua/_lib.lua``, Reservations.)"""

    sample_id: str
    attempt: str
    kind: GrantKind
    value: int


@dataclass(frozen=True, slots=True)
class GroupAdmission:
    """``admit_many``'s answer: the dataset's state and spec, and each sample's verdict and cap."""

    state: str
    spec: dict[str, Any] | None
    results: list[tuple[Admission, int]]


@dataclass(frozen=True, slots=True)
class CommitItem:
    """One generation to count (``commit_many``)."""

    sample_id: str
    attempt: str
    completion_tokens: int
    truncated: bool = False
    #: Of ``completion_tokens``, those the model spent thinking (SGLang's ``meta_info.reasoning_tokens``).
    reasoning_tokens: int = 0
    #: The generation ended at the dataset's ``max_new_tokens`` (finish reason ``length``), not cut short at
    #: its grant of the budget (that one is ``truncated``).
    hit_max_new: bool = False


@dataclass(frozen=True, slots=True)
class DatasetSnapshot:
    """One consistent read of a dataset's ledger."""

    name: str
    state: str
    token_budget: int | None
    max_samples: int | None
    on_budget: str
    tokens: int
    samples: int
    truncated: int
    live_tokens: int
    discarded_tokens: int
    wasted_tokens: int
    reclaimed: int
    failed: int
    queued: int
    inflight: int
    pending: int
    rejected: int
    source_total: int
    source_done: bool
    #: Tokens generated and samples committed per second, over the last ``RATE_WINDOW_S``.
    tokens_per_s: float = 0.0
    samples_per_s: float = 0.0
    #: A worker cannot write this dataset's output (disk full, read-only...): "host:pid: problem".
    output_error: str = ""
    #: Tokens of the budget granted to in-flight generations (``budget/lua/_lib.lua``, "Reservations").
    reserved_tokens: int = 0
    #: Of the tokens spent, those generated past their generations' grants (the step or two an abort at
    #: the grant takes to land).
    overdrawn_tokens: int = 0
    #: Of ``tokens``, those the model spent thinking (reasoning models); the rest is ``answer_tokens``.
    reasoning_tokens: int = 0
    #: Committed samples whose generation ended at the dataset's ``max_new_tokens``.
    hit_max_new: int = 0
    #: The most completion tokens of one committed sample.
    longest: int = 0
    #: Committed samples per length bucket (``budget/lengths.py``): tokens per sample as a histogram.
    lengths: dict[int, int] = field(default_factory=dict)
    #: Generations over whose records could not be written (a full disk), held in the ledger until they
    #: are (counted in ``inflight`` too: their leases stay), and the bytes they take there.
    held: int = 0
    held_bytes: int = 0
    #: Seconds since a producer (``tokenfleet submit``) last said it feeds the dataset (``Ledger.fed``);
    #: None if none ever did.
    fed_s_ago: float | None = None

    @property
    def answer_tokens(self) -> int:
        """Committed tokens that are not reasoning: the answers."""
        return self.tokens - self.reasoning_tokens

    @property
    def tokens_per_sample(self) -> float | None:
        """Mean completion tokens per committed sample (exact: tokens / samples); None before any."""
        return self.tokens / self.samples if self.samples else None

    @property
    def tokens_per_sample_p50(self) -> int | None:
        """Median completion tokens per sample: the upper bound of its histogram bucket, at most the
        longest sample (``budget/lengths.py``); None before any sample."""
        return percentile(self.lengths, 50, self.longest)

    @property
    def tokens_per_sample_p95(self) -> int | None:
        """95th percentile of completion tokens per sample, read as ``tokens_per_sample_p50``."""
        return percentile(self.lengths, 95, self.longest)

    @property
    def hit_max_new_share(self) -> float | None:
        """The share of committed samples that ended at ``max_new_tokens``; None before any sample."""
        return self.hit_max_new / self.samples if self.samples else None

    @property
    def settled(self) -> bool:
        """Nothing queued or in flight, and either a limit or the operator stopped it, or the source is
        consumed with nothing left to feed."""
        if self.queued or self.inflight:
            return False
        if self.state in (DatasetState.EXHAUSTED, DatasetState.REVOKED):
            return True
        return self.state == DatasetState.ACTIVE and self.source_done and self.pending == 0

    def as_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__} | {"settled": self.settled}


def _optional_int(value: str | None) -> int | None:
    return int(value) if value not in (None, "") else None


def _limit_arg(value: int | None) -> str:
    return "" if value is None else str(int(value))


def _translate_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Redis being unreachable becomes ``LedgerUnavailable``: callers show one line, not a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError, redis.AuthenticationError) as e:
            raise LedgerUnavailable(f"Redis is unreachable: {e}") from None

    return wrapper


def connect(url: str, *, patient: bool = False, **kwargs: Any) -> redis.Redis:
    """A redis-py client for ``url`` (``redis://``, ``rediss://`` with TLS, credentials in the URL).

    ``patient`` clients (workers, submit) ride out a Redis restart: each command is retried on connection
    errors with jittered exponential backoff for about ``PATIENCE_S``. Scripts survive it too: redis-py
    loads a script again when a restarted server answers NOSCRIPT. A retried write may have run once
    already; every script is safe to repeat (commit answers duplicate, admit answers leased and the lease
    expires, progress is corrected by the commit or release that follows).
    """
    kwargs.setdefault("socket_connect_timeout", 5)
    # redis-py's pool refuses a 101st connection at once ("Too many connections", not retried): a worker
    # process runs hundreds of generation threads, and a full disk sends many of them to the ledger together.
    kwargs.setdefault("max_connections", MAX_CONNECTIONS)
    kwargs.setdefault("health_check_interval", 30)
    if patient:
        kwargs.setdefault("retry", Retry(ExponentialWithJitterBackoff(base=0.1, cap=2.0), PATIENT_RETRIES))
        kwargs.setdefault("retry_on_error", [redis.ConnectionError, redis.TimeoutError])
    return redis.Redis.from_url(url, decode_responses=True, **kwargs)


class Ledger:
    """The per-dataset ledger: typed wrappers around the Lua scripts."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._scripts = register_scripts(client)

    @classmethod
    def from_url(cls, url: str, *, patient: bool = False) -> Ledger:
        return cls(connect(url, patient=patient))

    def _run(self, name: str, keys: Sequence[str], args: Sequence[Any] = ()) -> Any:
        return self._scripts[name](keys=list(keys), args=list(args))

    def _call(self, script: str, dataset: str, args: Sequence[Any] = (), **others: str) -> Any:
        """Run ``script`` for ``dataset``: its KEYS in the order ``budget.scripts.SCRIPT_KEYS`` declares."""
        keys = dataset_script_keys(script, dataset_keys(dataset), **others)
        return self._scripts[script](keys=keys, args=list(args))

    @_translate_errors
    def ping(self) -> None:
        self.client.ping()

    # --- datasets -------------------------------------------------------------------------------

    @_translate_errors
    def register(
        self, name: str, limits: DatasetLimits, spec: dict[str, Any]
    ) -> tuple[str, dict[str, int | None]]:
        """Create or update a dataset; returns its state and the limits kept at the value set live
        (``{"token_budget": 5000}``; None: removed live) instead of ``limits``' (``budget/lua/register.lua``
        says when). Counters and the done-set are kept."""
        sampling = spec.get("sampling") or {}
        max_new = sampling.get("max_new_tokens") if isinstance(sampling, dict) else None
        state, *kept = self._call(
            "register",
            name,
            [
                json.dumps(spec, sort_keys=True),
                _limit_arg(limits.token_budget),
                _limit_arg(limits.max_samples),
                limits.on_budget,
                int(max_new) if isinstance(max_new, int) else 0,
            ],
        )
        self.client.sadd(DATASETS_SET, name)
        return str(state), {str(f): _optional_int(v) for f, v in zip(kept[::2], kept[1::2], strict=True)}

    @_translate_errors
    def datasets(self) -> list[str]:
        return sorted(str(n) for n in self.client.smembers(DATASETS_SET))

    @_translate_errors
    def spec(self, name: str) -> dict[str, Any]:

        raw = self.client.get(dataset_keys(name).spec_str)
        if raw is None:
            raise UnknownDataset(name)
        spec: dict[str, Any] = json.loads(raw)
        return spec

    @_translate_errors
    def set_state(self, name: str, action: str) -> str:
        state: str = self._call("set_state", name, [action])
        if state == "unknown":
            raise UnknownDataset(name)
        if state in (DatasetState.PAUSED, DatasetState.REVOKED):
            self.announce_stop(name)
        return state

    def pause(self, name: str) -> str:
        return self.set_state(name, "pause")

    def resume(self, name: str) -> str:
        return self.set_state(name, "resume")

    def revoke(self, name: str) -> str:
        return self.set_state(name, "revoke")

    @_translate_errors
    def set_limits(
        self, name: str, token_budget: int | str | None = "-", max_samples: int | str | None = "-"
    ) -> str:
        """Change limits; ``"-"`` leaves one unchanged, ``None`` removes it. Returns the new state. A limit
        changed here is kept by a later ``register`` whose config still brings the value it brought before."""

        def arg(v: int | str | None) -> str:
            return v if isinstance(v, str) else _limit_arg(v)

        state: str = self._call("set_limits", name, [arg(token_budget), arg(max_samples)])
        if state == "unknown":
            raise UnknownDataset(name)
        self.announce_stop(name)  # a lowered budget may stop what runs now
        return state

    @_translate_errors
    def report_output_problem(self, name: str, reporter: str, problem: str) -> bool:
        """A worker cannot write ``name``'s output (``problem``), or can again (``""``: clears only the
        reporter's own). See ``budget/lua/output_problem.lua``."""
        return bool(self._call("output_problem", name, [reporter, problem]))

    # --- held records (a full output disk) ----------------------------------------------------------

    @_translate_errors
    def hold(
        self, name: str, sample_id: str, attempt: str, record: bytes, completion_tokens: int, max_bytes: int
    ) -> HoldOutcome:
        """Keep the record of a generation that could not be written, until a worker can write it
        (``budget/lua/hold.lua``); then ``commit_many`` counts it and ``unhold`` takes it out."""
        return HoldOutcome(
            self._call("hold", name, [sample_id, attempt, record, int(completion_tokens), int(max_bytes)])
        )

    @_translate_errors
    def held_records(self, name: str, count: int = 64) -> list[tuple[str, bytes]]:
        """Up to about ``count`` held records, each ``(sample_id, record JSON)``."""
        out: list[tuple[str, bytes]] = []
        for sid, record in self.client.hscan_iter(dataset_keys(name).held_hash, count=count):
            out.append((str(sid), str(record).encode()))
            if len(out) >= count:
                break
        return out

    @_translate_errors
    def held_count(self, name: str) -> int:
        return int(self.client.hget(dataset_keys(name).ledger_hash, "held") or 0)

    @_translate_errors
    def unhold(self, name: str, sample_ids: Sequence[str]) -> int:
        """Take written (and committed) records out of the held ones; returns how many were held."""
        if not sample_ids:
            return 0
        return int(self._call("unhold", name, list(sample_ids)))

    @_translate_errors
    def claim_held_flush(self, name: str, who: str, ms: int) -> bool:
        """Whether ``who`` may write ``name``'s held records now (one process at a time, for ``ms``)."""
        key = dataset_keys(name).held_flush_str
        return bool(self.client.set(key, who, nx=True, px=ms)) or self.client.get(key) == who

    @_translate_errors
    def end_held_flush(self, name: str, who: str) -> None:
        key = dataset_keys(name).held_flush_str
        with self.client.pipeline() as pipe:  # only the claim's own holder ends it (WATCH, then MULTI)
            try:
                pipe.watch(key)
                if pipe.get(key) == who:
                    pipe.multi()
                    pipe.delete(key)
                    pipe.execute()
            except redis.WatchError:  # taken over meanwhile: not ours to end
                pass

    # --- stopping in-flight generations -------------------------------------------------------------

    @_translate_errors
    def announce_stop(self, name: str) -> None:
        """Tell every worker process that ``name`` may have to stop its in-flight generations. Each
        checks ``stop_reasons`` (the ledger decides) before aborting anything, so a spurious message costs
        one read. Pub/sub is fire-and-forget: watchers also poll, so a lost message only delays a stop."""
        self.client.publish(STOPS_CHANNEL, name)

    def subscribe_stops(self) -> redis.client.PubSub:
        """A pub/sub connection listening to ``announce_stop``."""
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(STOPS_CHANNEL)
        return pubsub

    @_translate_errors
    def stop_reasons(self, names: Iterable[str]) -> dict[str, str]:
        """For each dataset, why its in-flight generations must stop now (``revoked``, ``paused``,
        ``budget``, ``max_samples``, ``unknown``), or ``""`` to go on (``budget/lua/stop_check.lua``).
        One round trip."""
        names = list(names)
        if not names:
            return {}
        if len(names) == 1:  # no pipeline: a pipeline of scripts asks SCRIPT EXISTS first, every time
            return {names[0]: str(self._call("stop_check", names[0]))}
        pipe = self.client.pipeline(transaction=False)
        script = self._scripts["stop_check"]
        for name in names:
            script(keys=dataset_script_keys("stop_check", dataset_keys(name)), args=[], client=pipe)
        return {name: str(reason) for name, reason in zip(names, pipe.execute(), strict=True)}

    # --- producer -------------------------------------------------------------------------------

    @_translate_errors
    def enqueue(self, name: str, sample_ids: Sequence[str], window: int) -> list[int]:
        """Which of ``sample_ids`` to publish now (codes ``ENQUEUE_*``); marks those as queued. One script
        call per ``ENQUEUE_CHUNK`` ids (a Lua call takes a bounded number of arguments)."""
        codes: list[int] = []
        for start in range(0, max(1, len(sample_ids)), ENQUEUE_CHUNK):
            chunk = [
                int(c)
                for c in self._call("enqueue", name, [window, *sample_ids[start : start + ENQUEUE_CHUNK]])
            ]
            if codes and chunk and chunk[0] in (ENQUEUE_NOT_ACTIVE, ENQUEUE_BUDGET_IN_FLIGHT):
                # a later chunk may publish none (the earlier ones filled what the budget lets through,
                # or the dataset stopped meanwhile): for the caller, the ids from here on wait, as at a
                # full window (a code it reads only first would leave them neither published nor back)
                chunk = [ENQUEUE_WINDOW_FULL]
            codes += chunk
            if not chunk or chunk[-1] < 0:  # the window is full, or the dataset may not start any
                break
        return codes

    @_translate_errors
    def unqueue(self, name: str, sample_ids: Sequence[str], reason: str) -> int:
        return int(self._call("unqueue", name, [reason, *sample_ids]))

    @_translate_errors
    def set_source(
        self,
        name: str,
        *,
        total: int | None = None,
        done: bool | None = None,
        rejected: int | None = None,
    ) -> None:
        def arg(v: int | bool | None) -> str:
            return "-" if v is None else str(int(v))

        self._call("set_source", name, [arg(total), arg(done), arg(rejected)])

    @_translate_errors
    def pending_ids(self, name: str) -> set[str]:
        """Samples taken from the queue without a result (to feed again)."""
        return {str(k) for k in self.client.hkeys(dataset_keys(name).pending_hash)}

    @_translate_errors
    def pending_reasons(self, name: str, most: int = 10_000) -> dict[str, int]:
        """Why samples went back to pending, with how many each, over the first ``most`` of them (one
        scan: ``tokenfleet status NAME`` shows it)."""
        counts: dict[str, int] = {}
        for seen, (_, reason) in enumerate(
            self.client.hscan_iter(dataset_keys(name).pending_hash, count=1000)
        ):
            if seen >= most:
                break
            counts[str(reason)] = counts.get(str(reason), 0) + 1
        return counts

    @_translate_errors
    def is_done(self, name: str, sample_ids: Iterable[str]) -> list[bool]:
        k = dataset_keys(name)
        pipe = self.client.pipeline(transaction=False)
        for sid in sample_ids:
            pipe.hexists(k.done_hash, sid)
        return [bool(x) for x in pipe.execute()]

    # --- worker ---------------------------------------------------------------------------------

    @_translate_errors
    def admit_many(
        self,
        name: str,
        samples: Sequence[tuple[str, str, int] | tuple[str, str, int, bool]],
        lease_ms: int = DEFAULT_LEASE_MS,
    ) -> GroupAdmission:
        """Admit a group of samples in one call: each ``(sample_id, attempt, want[, whole])``, where
        ``want`` is the most tokens its generation may produce (0: the dataset's ``max_new_tokens``) and
        ``whole`` (default False) says its generation cannot be continued past a grant, so under a token
        budget its grant is its whole want while that much is left (truncate: a share past that, where it
        is cut). See ``budget/lua/admit.lua``."""
        args: list[Any] = [lease_ms]
        for ask in samples:
            whole = len(ask) > 3 and bool(ask[3])
            args += [ask[0], ask[1], int(ask[2]), 1 if whole else 0]
        flat = self._call("admit", name, args)
        state, spec = str(flat[0]), flat[1]
        verdicts = flat[2:]
        results = [(Admission(verdicts[i]), int(verdicts[i + 1])) for i in range(0, len(verdicts), 2)]
        return GroupAdmission(state, json.loads(spec) if spec else None, results)

    def admit(
        self, name: str, sample_id: str, attempt: str, lease_ms: int = DEFAULT_LEASE_MS, want: int = 0
    ) -> AdmitResult:
        group = self.admit_many(name, [(sample_id, attempt, want)], lease_ms)
        admission, cap = group.results[0]
        return AdmitResult(admission, group.state, group.spec if admission is Admission.OK else None, cap)

    @_translate_errors
    def grant_many(self, name: str, asks: Sequence[GrantAsk], slots: int = 0) -> list[int]:
        """Grants of a token budget for generations with a server slot, in one call
        (``budget/lua/grant.lua``): each ask starts a generation, asks more for one that reached its grant,
        or gives back what one that ended did not use. ``slots``: the slots of the dataset's servers, as
        the caller knows them (0: unknown). Returns, per ask, the generation's grant after the call, or
        ``GRANT_NOT_NOW`` / ``GRANT_WAIT`` / ``GRANT_DROPPED`` for a start that gets none, 0 when the attempt
        lost its lease."""
        if not asks:
            return []
        args: list[Any] = [max(0, int(slots))]
        for ask in asks:
            args += [ask.sample_id, ask.attempt, ask.kind.value, max(0, int(ask.value))]
        return [int(x) for x in self._call("grant", name, args)]

    @_translate_errors
    def progress(
        self, name: str, sample_id: str, attempt: str, lease_ms: int = DEFAULT_LEASE_MS
    ) -> tuple[Progress, str]:
        """Whether an attempt between two tries (or whose stream ended) may go on; renews its lease.
        Returns the verdict and the dataset's state, or, where a limit stops it, ``STOP_BUDGET`` or
        ``STOP_MAX_SAMPLES`` in place of the state."""
        action, state = self._call("progress", name, [sample_id, attempt, lease_ms])
        return Progress(action), state

    def renew_many(
        self, name: str, leases: Sequence[tuple[str, str, int | None]], lease_ms: int = DEFAULT_LEASE_MS
    ) -> list[bool]:
        """Renew leases of one dataset in one call, each ``(sample_id, attempt, live_tokens)`` (tokens
        generated so far, for status; None: not known). Returns, per lease, whether it is still held."""
        return self.renew_report(name, leases, lease_ms).held

    @_translate_errors
    def renew_report(
        self, name: str, leases: Sequence[tuple[str, str, int | None]], lease_ms: int = DEFAULT_LEASE_MS
    ) -> Renewal:
        """``renew_many``, and whether the ledger wants the live tokens again soon (``Renewal.soon``)."""
        if not leases:
            return Renewal([], False)
        args: list[Any] = [lease_ms]
        for sid, attempt, live in leases:
            args += [sid, attempt, "-" if live is None else int(live)]
        *held, soon = self._call("renew", name, args)
        return Renewal([bool(x) for x in held], bool(soon))

    def renew(self, name: str, sample_id: str, attempt: str, lease_ms: int = DEFAULT_LEASE_MS) -> bool:
        return self.renew_many(name, [(sample_id, attempt, None)], lease_ms)[0]

    @_translate_errors
    def commit_many(self, name: str, items: Sequence[CommitItem]) -> list[CommitOutcome]:
        """Count a batch of generations whose records are written, in one call (``budget/lua/commit.lua``):
        each exactly once. A batch that spends a discard budget announces the stop of what still runs."""
        if not items:
            return []
        args: list[Any] = []
        for it in items:
            tokens = int(it.completion_tokens)
            args += [
                it.sample_id,
                it.attempt,
                tokens,
                int(it.truncated),
                min(max(0, int(it.reasoning_tokens)), max(0, tokens)),
                int(it.hit_max_new),
                bucket_of(tokens),
            ]
        flat = self._call("commit", name, args)
        if int(flat[1]):
            self.announce_stop(name)
        return [CommitOutcome(o) for o in flat[2:]]

    def commit(
        self, name: str, sample_id: str, attempt: str, completion_tokens: int, truncated: bool = False
    ) -> CommitOutcome:
        return self.commit_many(name, [CommitItem(sample_id, attempt, completion_tokens, truncated)])[0]

    @_translate_errors
    def fail(
        self, name: str, sample_id: str, attempt: str, reason: str, wasted_tokens: int = 0
    ) -> FailOutcome:
        return FailOutcome(
            self._call(
                "fail",
                name,
                [sample_id, attempt, reason, wasted_tokens],
            )
        )

    @_translate_errors
    def release(
        self,
        name: str,
        sample_id: str,
        attempt: str,
        reason: str,
        thrown_away_tokens: int = 0,
        counts_against_budget: bool = False,
    ) -> ReleaseOutcome:
        return ReleaseOutcome(
            self._call(
                "release",
                name,
                [sample_id, attempt, reason, thrown_away_tokens, int(counts_against_budget)],
            )
        )

    @_translate_errors
    def purge_queue(self, name: str, queue_key: str, reason: str) -> int:
        """Remove ``name``'s waiting messages from the broker list ``queue_key``; their samples become
        pending with ``reason``. Returns how many messages were removed."""
        return int(self._call("purge_queue", name, [name, reason], queue=queue_key))

    @_translate_errors
    def audit_queued(self, name: str, queue_key: str, older_than_ms: int = DEFAULT_QUEUED_AUDIT_MS) -> int:
        """Samples marked queued long ago whose message is gone from ``queue_key`` become pending."""
        return int(self._call("audit_queued", name, [name, older_than_ms], queue=queue_key))

    @_translate_errors
    def give_up(
        self,
        name: str,
        sample_id: str,
        attempt: str,
        reason: str,
        wasted_tokens: int = 0,
        max_strikes: int = defaults.MAX_STRIKES,
    ) -> GiveUpOutcome:
        """Retries ran out: the sample is pending again, or failed after ``max_strikes`` give-ups."""
        return GiveUpOutcome(
            self._call("give_up", name, [sample_id, attempt, reason, wasted_tokens, max_strikes])
        )

    @_translate_errors
    def reclaim(self, name: str) -> int:
        return int(
            self._call(
                "reclaim",
                name,
            )
        )

    @_translate_errors
    def clear_pending(self, name: str, orphans: Sequence[str], stale: Sequence[str] = ()) -> tuple[int, int]:
        """After a whole pass over the source: drop the pending marks of ``orphans`` (no longer in the
        source; counted in the ledger's ``not_in_source``) and of ``stale`` ids that are done or failed by
        now. Returns (orphans cleared, stale cleared); see ``budget/lua/clear_pending.lua``."""
        if not orphans and not stale:
            return (0, 0)
        cleared = self._call(
            "clear_pending",
            name,
            [len(orphans), *orphans, *stale],
        )
        return int(cleared[0]), int(cleared[1])

    # --- reading --------------------------------------------------------------------------------

    @_translate_errors
    def snapshot(self, name: str) -> DatasetSnapshot:
        flat = self._call(
            "snapshot",
            name,
            [RATE_WINDOW_S],
        )
        if not flat:
            raise UnknownDataset(name)
        f: dict[str, Any] = dict(zip(flat[::2], flat[1::2], strict=True))

        def n(field: str) -> int:
            return int(f.get(field) or 0)

        return DatasetSnapshot(
            name=name,
            state=f["state"],
            token_budget=_optional_int(f.get("token_budget")),
            max_samples=_optional_int(f.get("max_samples")),
            on_budget=f.get("on_budget") or defaults.ON_BUDGET,
            tokens=n("tokens"),
            samples=n("samples"),
            truncated=n("truncated"),
            live_tokens=n("live_tokens"),
            discarded_tokens=n("discarded_tokens"),
            wasted_tokens=n("wasted_tokens"),
            reclaimed=n("reclaimed"),
            failed=n("failed"),
            queued=n("queued"),
            inflight=n("inflight"),
            pending=n("pending"),
            rejected=n("rejected"),
            source_total=n("source_total"),
            source_done=bool(n("source_done")),
            tokens_per_s=n("rate_tokens") / max(1.0, n("rate_span_ms") / 1000),
            samples_per_s=n("rate_samples") / max(1.0, n("rate_span_ms") / 1000),
            output_error=f"{f['output_error_by']}: {f['output_error']}" if f.get("output_error") else "",
            reserved_tokens=n("reserved_tokens"),
            overdrawn_tokens=n("overdrawn_tokens"),
            reasoning_tokens=n("reasoning_tokens"),
            hit_max_new=n("hit_max_new"),
            longest=n("longest"),
            lengths=parse_histogram(f.get("lengths")),
            held=n("held"),
            held_bytes=n("held_bytes"),
            fed_s_ago=max(0.0, (n("now_ms") - n("fed_at_ms")) / 1000) if f.get("fed_at_ms") else None,
        )

    @_translate_errors
    def fed(self, name: str) -> bool:
        """A producer feeding ``name`` says so (``budget/lua/fed.lua``); False if the dataset is unknown."""
        return bool(self._call("fed", name, []))

    @_translate_errors
    def done_attempts(self, name: str) -> dict[str, str]:
        """The done-set: sample id -> attempt id of the committed generation (for export)."""
        k = dataset_keys(name)
        out: dict[str, str] = {}
        for sid, attempt in self.client.hscan_iter(k.done_hash, count=10_000):
            out[sid] = attempt
        return out

    @_translate_errors
    def failures(self, name: str) -> dict[str, str]:
        raw = self.client.hgetall(dataset_keys(name).failed_hash)
        return {str(k): str(v) for k, v in raw.items()}

    @_translate_errors
    def rebuild(
        self,
        name: str,
        done: dict[str, str],
        tokens: int,
        truncated: int,
        failed: dict[str, str],
        chunk: int = 10_000,
        *,
        reasoning_tokens: int = 0,
        hit_max_new: int = 0,
        lengths: Sequence[int] = (),
    ) -> str:
        """Replace ``name``'s done-set, failures and counters with what the output files hold (reconcile),
        in one MULTI transaction: ``lengths`` are the committed samples' completion tokens (for the lengths
        histogram and the longest). Queued, in-flight and pending samples are cleared: run it with the
        fleet stopped. Returns the dataset's state after its limits are applied again."""
        k = dataset_keys(name)
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(
            k.done_hash,
            k.failed_hash,
            k.queued_zset,
            k.lease_zset,
            k.lease_owner_hash,
            k.live_hash,
            k.reserved_hash,
            k.clock_hash,
            k.pending_hash,
            k.strikes_hash,
            k.lengths_hash,
        )
        histogram: dict[int, int] = {}
        for tokens_of_one in lengths:
            bucket = bucket_of(tokens_of_one)
            histogram[bucket] = histogram.get(bucket, 0) + 1
        if histogram:
            pipe.hset(k.lengths_hash, mapping={str(b): count for b, count in histogram.items()})
        items = list(done.items())
        for i in range(0, len(items), chunk):
            pipe.hset(k.done_hash, mapping=dict(items[i : i + chunk]))
        fails = list(failed.items())
        for i in range(0, len(fails), chunk):
            pipe.hset(k.failed_hash, mapping=dict(fails[i : i + chunk]))
        pipe.hset(
            k.ledger_hash,
            mapping={
                "tokens": tokens,
                "samples": len(done),
                "truncated": truncated,
                "live_tokens": 0,
                "reserved_tokens": 0,
                "clock_n": 0,
                "clock_sum": 0,
                "clock_grant": 0,
                "reasoning_tokens": reasoning_tokens,
                "hit_max_new": hit_max_new,
                "longest": max(lengths, default=0),
            },
        )
        pipe.execute()
        return self.set_limits(name)

    @_translate_errors
    def identity(self, name: str) -> dict[str, str]:
        """What ties ``name`` to its outputs and first submit (``IDENTITY_FIELDS``); {} when unknown."""
        raw = self.client.hgetall(dataset_keys(name).identity_hash)
        return {str(k): str(v) for k, v in raw.items()}

    @_translate_errors
    def set_identity(self, name: str, **fields: str) -> None:
        """Set some of ``IDENTITY_FIELDS`` of ``name`` (in one MULTI transaction: atomic)."""
        unknown = set(fields) - set(IDENTITY_FIELDS)
        if unknown:
            raise ValueError(f"unknown identity field(s): {sorted(unknown)}")
        if fields:
            pipe = self.client.pipeline(transaction=True)
            for field_name, value in fields.items():
                pipe.hset(dataset_keys(name).identity_hash, field_name, value)
            pipe.execute()

    @_translate_errors
    def source_digest(self, name: str) -> str | None:
        raw = self.client.get(dataset_keys(name).source_digest_str)
        return None if raw is None else str(raw)

    @_translate_errors
    def set_source_digest(self, name: str, digest: str) -> None:
        self.client.set(dataset_keys(name).source_digest_str, digest)

    @_translate_errors
    def persistence(self) -> dict[str, str] | None:
        """Redis's ``appendonly`` and ``save`` settings, or None when it forbids CONFIG GET."""
        try:
            out: dict[str, str] = {}
            for key in ("appendonly", "save"):
                out |= {str(k): str(v) for k, v in self.client.config_get(key).items()}
            return out
        except redis.ResponseError:
            return None

    @_translate_errors
    def heartbeat(self, worker: str, facts: dict[str, Any] | None) -> None:
        """Record that ``worker`` is alive with ``facts`` (JSON-able); ``None`` removes it."""
        keys = [WORKERS_HASH]  # budget.scripts.SCRIPT_KEYS["heartbeat"]: ("workers",)
        self._run("heartbeat", keys, [worker, json.dumps(facts) if facts is not None else ""])

    @_translate_errors
    def workers(self, seen_within_s: float = WORKER_SEEN_WITHIN_S) -> list[dict[str, Any]]:
        """Workers whose last heartbeat is at most ``seen_within_s`` old (by the Redis server's clock),
        each with its facts, ``name`` and ``age_s``."""
        t = self.client.time()
        now_ms = int(t[0]) * 1000 + int(t[1]) // 1000
        out = []
        for name, raw in sorted(self.client.hgetall(WORKERS_HASH).items()):
            facts = json.loads(raw)
            age_s = (now_ms - int(facts.get("last_seen_ms", 0))) / 1000
            if age_s <= seen_within_s:
                out.append(facts | {"name": str(name), "age_s": round(age_s, 1)})
        return out

    @_translate_errors
    def forget(self, name: str) -> None:
        """Delete every key of dataset ``name`` (its counters, done-set and leases) in one transaction."""
        k = dataset_keys(name)
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(*(getattr(k, f) for f in k.__dataclass_fields__))
        pipe.srem(DATASETS_SET, name)
        pipe.execute()

    def keys_of(self, name: str) -> DatasetKeys:
        return dataset_keys(name)
