"""The simulator's continuous-batching engine: pure asyncio, no HTTP.

One step loop stands in for the GPU: every ``step_time_s`` it admits waiting requests (FIFO, up to
``max_running_requests``) and gives every running request one token. Outputs are planned up front from a
stable hash of the prompt, so a step only bumps counters; a request's task is woken only at its stream
boundaries and when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import hashlib
import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import IO, Any, Final

import orjson

from workers.sglang.protocol import (
    ABORT_MESSAGE_REQUESTED,
    ABORT_MESSAGE_WAITING_QUEUE,
    ERR_TYPE_BAD_REQUEST,
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    QUEUE_FULL_MESSAGE,
    RUNNING_TIMEOUT_MESSAGE,
    SGLANG_DEFAULT_MAX_NEW_TOKENS,
    WAITING_TIMEOUT_MESSAGE,
    FinishReason,
    duplicate_rid_error,
    input_too_long_error,
)

#: Ids below this are special (pad, bos, eos) in the simulated vocabulary.
FIRST_REGULAR_TOKEN: Final = 3

#: The simulated model's own context length (its config.json), used unless --context-length is given.
MODEL_CONTEXT_LENGTH: Final = 8192
#: Batch size per data-parallel rank when --max-running-requests is not given (SGLang sizes it from memory).
DEFAULT_RUNNING_REQUESTS_PER_DP: Final = 256
#: SGLang's scheduler keeps this many tokens of the context (or KV pool) off the longest prompt.
MAX_REQ_INPUT_RESERVE: Final = 6

#: Knobs ``POST /sim/config`` may change while the server runs.
RUNTIME_KNOBS: Final[frozenset[str]] = frozenset(
    {
        "error_rate",
        "drop_rate",
        "abort_rate",
        "step_time_s",
        "step_time_per_request_s",
        "fixed_output_len",
        "output_len_mean",
        "wedged",
        "reasoning_fraction",
    }
)
#: Fields never shown by the server (``/server_info``, ``/sim/config``) nor logged.
SECRET_FIELDS: Final[frozenset[str]] = frozenset({"api_key", "admin_api_key"})


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class SimConfig:
    """Everything the simulator can be told; each field is also a CLI flag (``--step-time-s``)."""

    host: str = field(default="127.0.0.1", metadata=_help("address to listen on"))
    port: int = field(default=30000, metadata=_help("port to listen on; 0 picks a free one"))
    step_time_s: float = field(default=0.01, metadata=_help("one decode step for all running requests"))
    step_time_per_request_s: float = field(
        default=0.0,
        metadata=_help("added to each decode step per running request (a GPU's step grows with its batch)"),
    )
    max_running_requests: int | None = field(
        default=None,
        metadata=_help(
            "batch size over all data-parallel ranks; further requests wait in a FIFO queue "
            f"(default: none given, so {DEFAULT_RUNNING_REQUESTS_PER_DP} per rank; /server_info says null)"
        ),
    )
    context_length: int | None = field(
        default=None,
        metadata=_help(
            f"context length in tokens (default: none given, so the model's {MODEL_CONTEXT_LENGTH})"
        ),
    )
    max_total_tokens: int | None = field(
        default=None,
        metadata=_help("KV pool size in tokens (default: enough for every running request's full context)"),
    )
    dp_size: int = field(default=1, metadata=_help("data-parallel ranks reported by /server_info"))
    max_queued_requests: int | None = field(
        default=None, metadata=_help("waiting queue size; a request beyond it is shed with a 503")
    )
    req_waiting_timeout_s: float | None = field(
        default=None, metadata=_help("shed a request waiting longer (SGLANG_REQ_WAITING_TIMEOUT)")
    )
    req_running_timeout_s: float | None = field(
        default=None, metadata=_help("shed a request running longer (SGLANG_REQ_RUNNING_TIMEOUT)")
    )
    stream_interval: int = field(
        default=1, metadata=_help("tokens between streamed chunks unless a request sets its own")
    )
    incremental_streaming_output: bool = field(
        default=False, metadata=_help("stream output_ids and text as deltas instead of cumulative")
    )
    vocab_size: int = field(
        default=32000, metadata=_help("input ids must be below this; output ids are (also in config.json)")
    )
    eos_token_id: int = field(default=2, metadata=_help("token that ends a natural stop"))
    crash_on_bad_token_id: bool = field(
        default=True,
        metadata=_help(
            "an input id outside the vocabulary crashes the server, as SGLang does; "
            "--no-crash-on-bad-token-id aborts that request with a 400 instead"
        ),
    )
    output_len_mean: float = field(
        default=200.0, metadata=_help("mean tokens a prompt wants before EOS (lognormal)")
    )
    output_len_sigma: float = field(default=0.6, metadata=_help("sigma of the lognormal output length"))
    fixed_output_len: int | None = field(
        default=None, metadata=_help("every prompt wants exactly this many tokens before EOS")
    )
    omit_output_ids: bool = field(default=False, metadata=_help("answer like sglang 0.4: no output_ids"))
    reasoning_fraction: float = field(
        default=0.0,
        metadata=_help(
            "the first F of each answer's planned tokens are thinking: meta_info.reasoning_tokens counts "
            "them (default 0: the field stays 0, as for a model that does not think)"
        ),
    )
    error_rate: float = field(default=0.0, metadata=_help("fraction of /generate answered HTTP 503"))
    drop_rate: float = field(default=0.0, metadata=_help("fraction of requests whose connection is cut"))
    abort_rate: float = field(
        default=0.0, metadata=_help("fraction of requests the server aborts (retracted, then aborted)")
    )
    seed: int = field(default=0, metadata=_help("seed of the fault decisions"))
    wedged: bool = field(
        default=False,
        metadata=_help("the engine makes no progress (no decode step) while /health still answers 200"),
    )
    model_path: str | None = field(
        default=None,
        metadata=_help("model folder reported by /model_info (default: a temp folder with a config.json)"),
    )
    tokenizer_path: str | None = field(
        default=None, metadata=_help("reported tokenizer path (default: the model path)")
    )
    api_key: str | None = field(default=None, metadata=_help("require 'Authorization: Bearer KEY'"))
    admin_api_key: str | None = field(
        default=None, metadata=_help("the only key /abort_request and the /sim/ routes accept")
    )
    enable_metrics: bool = field(default=False, metadata=_help("serve Prometheus text on /metrics"))
    health_check_timeout_s: float = field(
        default=20.0, metadata=_help("/health answers 503 when its 1-token generation takes longer")
    )
    request_log: str | None = field(
        default=None,
        metadata=_help(
            "append a JSON line per finished request to this file (its rid, when it arrived, started and "
            "ended on the simulator's monotonic clock, its prompt and completion tokens, how it ended)"
        ),
    )

    def __post_init__(self) -> None:
        _check_config(self)

    @property
    def running_requests_per_dp(self) -> int:
        """The batch size in force on each data-parallel rank."""
        if self.max_running_requests is None:
            return DEFAULT_RUNNING_REQUESTS_PER_DP
        return max(1, self.max_running_requests // self.dp_size)

    @property
    def batch_size(self) -> int:
        return self.running_requests_per_dp * self.dp_size

    @property
    def effective_context_length(self) -> int:
        return self.context_length if self.context_length is not None else MODEL_CONTEXT_LENGTH

    @property
    def kv_pool_tokens(self) -> int:
        if self.max_total_tokens is not None:
            return self.max_total_tokens
        return self.batch_size * self.effective_context_length

    @property
    def max_req_input_len(self) -> int:
        """The longest prompt the scheduler takes: about ``min(context, KV pool) - 6``."""
        return min(self.effective_context_length, self.kv_pool_tokens) - MAX_REQ_INPUT_RESERVE

    def public(self) -> dict[str, Any]:
        """The fields, keys left out."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in SECRET_FIELDS}


def _check_config(config: SimConfig) -> None:
    problems = [
        *(
            f"{name} must be within [0, 1]"
            for name in ("error_rate", "drop_rate", "abort_rate", "reasoning_fraction")
            if not 0.0 <= getattr(config, name) <= 1.0
        ),
        *(
            f"{name} must be positive"
            for name in (
                "max_running_requests",
                "context_length",
                "max_total_tokens",
                "dp_size",
                "max_queued_requests",
                "req_waiting_timeout_s",
                "req_running_timeout_s",
                "stream_interval",
                "output_len_mean",
                "health_check_timeout_s",
            )
            if getattr(config, name) is not None and getattr(config, name) <= 0
        ),
    ]
    if config.step_time_s < 0:
        problems.append("step_time_s must not be negative")
    if config.step_time_per_request_s < 0:
        problems.append("step_time_per_request_s must not be negative")
    if config.output_len_sigma < 0:
        problems.append("output_len_sigma must not be negative")
    if config.vocab_size <= FIRST_REGULAR_TOKEN + 1:
        problems.append(f"vocab_size must be above {FIRST_REGULAR_TOKEN + 1}")
    if config.fixed_output_len is not None and config.fixed_output_len < 0:
        problems.append("fixed_output_len must not be negative")
    if not problems and config.max_req_input_len < 1:
        problems.append(f"context_length and max_total_tokens must be above {MAX_REQ_INPUT_RESERVE}")
    if problems:
        raise ValueError("; ".join(problems))


def updated_config(config: SimConfig, changes: Mapping[str, Any]) -> SimConfig:
    """``config`` with the runtime knobs in ``changes`` applied; ValueError on anything else."""
    unknown = sorted(set(changes) - RUNTIME_KNOBS)
    if unknown:
        knobs = ", ".join(sorted(RUNTIME_KNOBS))
        raise ValueError(f"not a runtime knob: {', '.join(unknown)} (knobs: {knobs})")
    values: dict[str, Any] = {name: _coerce_knob(name, value) for name, value in changes.items()}
    return dataclasses.replace(config, **values)


def _coerce_knob(name: str, value: Any) -> float | int | bool | None:
    if name == "wedged":
        if isinstance(value, bool):
            return value
        raise ValueError("wedged must be true or false")
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if name == "fixed_output_len":
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        raise ValueError("fixed_output_len must be an integer or null")
    if not is_number:
        raise ValueError(f"{name} must be a number")
    return float(value)


# --- the simulated tokenizer -------------------------------------------------------------------------


def tokenize(text: str, vocab_size: int) -> list[int]:
    """UTF-8 bytes shifted past the special ids: deterministic and reversible enough for a simulator."""
    span = vocab_size - FIRST_REGULAR_TOKEN
    return [FIRST_REGULAR_TOKEN + byte % span for byte in text.encode()]


def detokenize(token_ids: Sequence[int]) -> str:
    return "".join(f" w{token}" for token in token_ids)


# --- output planning ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """The ``sampling_params`` that change what the simulator generates."""

    max_new_tokens: int = SGLANG_DEFAULT_MAX_NEW_TOKENS
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True)
class OutputPlan:
    """What a request produces if nothing interrupts it."""

    token_ids: tuple[int, ...]
    finish_reason: FinishReason


def prompt_digest(prompt_ids: Sequence[int], sample: int = 0) -> bytes:
    """A stable digest of the prompt; sample ``i > 0`` of an ``n > 1`` request gets its own."""
    # Python's hash() is salted per process; the outputs must not change between runs or servers.
    text = ",".join(map(str, prompt_ids)) + (f"#{sample}" if sample else "")
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def reasoning_length(plan: OutputPlan, config: SimConfig) -> int:
    """How many of the plan's tokens are thinking: its first ``reasoning_fraction``, rounded down."""
    return math.floor(config.reasoning_fraction * len(plan.token_ids))


def wanted_length(digest: bytes, config: SimConfig) -> int:
    """How many tokens the prompt wants before EOS."""
    if config.fixed_output_len is not None:
        return config.fixed_output_len
    sigma = config.output_len_sigma
    mu = math.log(config.output_len_mean) - sigma * sigma / 2  # so that the mean is output_len_mean
    return max(1, round(random.Random(digest[:8]).lognormvariate(mu, sigma)))


def plan_output(
    prompt_ids: Sequence[int], sampling: SamplingSpec, config: SimConfig, sample: int = 0
) -> OutputPlan:
    return _plan(PlanCursor.of(prompt_ids, sample, config), sampling, config)[0]


@dataclass(slots=True)
class PlanCursor:
    """Where a prompt's plan stands: the tokens' random stream, the length it wants before EOS, and how
    many tokens were drawn. A request that continues another (``SimEngine``: its prompt is the other's
    prompt and output, that one having ended at its max_new_tokens) goes on from the other's cursor, as a
    real model goes on with the same distribution over the same context; and costs only its own tokens."""

    rng: random.Random
    wanted: int
    position: int = 0

    @classmethod
    def of(cls, prompt_ids: Sequence[int], sample: int, config: SimConfig) -> PlanCursor:
        digest = prompt_digest(prompt_ids, sample)
        # A separate stream for the tokens, so the length knobs never change which tokens come out.
        return cls(random.Random(digest[8:]), wanted_length(digest, config))


def _plan(cursor: PlanCursor, sampling: SamplingSpec, config: SimConfig) -> tuple[OutputPlan, PlanCursor]:
    """The next ``sampling.max_new_tokens`` at most of the plan at ``cursor``, and the cursor after them
    (``cursor`` itself is left as it was)."""
    rng = random.Random()
    rng.setstate(cursor.rng.getstate())
    stops = not sampling.ignore_eos  # SGLang's ignore_eos disables stop_token_ids too
    tokens: list[int] = []
    reason = length_reason(sampling.max_new_tokens)
    for position in range(cursor.position, cursor.position + sampling.max_new_tokens):
        if stops and position == cursor.wanted:
            tokens.append(config.eos_token_id)
            reason = stop_reason(config.eos_token_id)
            break
        token = _draw_token(rng, config)
        tokens.append(token)
        if stops and token in sampling.stop_token_ids:
            reason = stop_reason(token)
            break
    return OutputPlan(tuple(tokens), reason), PlanCursor(rng, cursor.wanted, cursor.position + len(tokens))


#: Continuable prompts the simulator remembers (a request's prompt plus its output, the request having
#: ended at its max_new_tokens: what a radix cache holds), at most this many, the oldest forgotten first.
CONTINUATIONS_KEPT: Final = 8192


def _draw_token(rng: random.Random, config: SimConfig) -> int:
    while True:
        token = rng.randrange(FIRST_REGULAR_TOKEN, config.vocab_size)
        if token != config.eos_token_id:
            return token


def stop_reason(matched: int) -> FinishReason:
    return {"type": FINISH_STOP, "matched": matched}


def length_reason(max_new_tokens: int) -> FinishReason:
    return {"type": FINISH_LENGTH, "length": max_new_tokens}


def abort_reason(message: str, status_code: int | None = None, err_type: str | None = None) -> FinishReason:
    return {"type": FINISH_ABORT, "message": message, "status_code": status_code, "err_type": err_type}


def bad_request_abort(message: str) -> FinishReason:
    """An abort for the input's fault, as the scheduler sends it on the last chunk."""
    return abort_reason(message, HTTPStatus.BAD_REQUEST.value, ERR_TYPE_BAD_REQUEST)


def shed_abort(message: str) -> FinishReason:
    """An abort of a request the server sheds (queue full, timeouts): a 503 when not streaming."""
    return abort_reason(message, HTTPStatus.SERVICE_UNAVAILABLE.value)


def out_of_vocab_error(token_id: int, vocab_size: int) -> str:
    """What the real server's scheduler dies of (torch's embedding lookup), with the id named."""
    return f"IndexError: index out of range in self (input id {token_id} is outside [0, {vocab_size}))"


def first_bad_token(prompt_ids: Sequence[int], vocab_size: int) -> int | None:
    return next((t for t in prompt_ids if not 0 <= t < vocab_size), None)


# --- faults ------------------------------------------------------------------------------------------


class Fault(enum.Enum):
    NONE = "none"
    ERROR_503 = "error_503"
    DROP = "drop"
    ABORT = "abort"


@dataclass(frozen=True, slots=True)
class FaultDraw:
    kind: Fault
    at_fraction: float  # where in the output a drop or abort strikes


def draw_fault(rng: random.Random, config: SimConfig) -> FaultDraw:
    # Always four draws, whatever the rates, so one knob never shifts the others' decisions.
    error, drop, abort, at_fraction = (rng.random() for _ in range(4))
    if error < config.error_rate:
        return FaultDraw(Fault.ERROR_503, at_fraction)
    if drop < config.drop_rate:
        return FaultDraw(Fault.DROP, at_fraction)
    if abort < config.abort_rate:
        return FaultDraw(Fault.ABORT, at_fraction)
    return FaultDraw(Fault.NONE, at_fraction)


class DuplicateRequestError(ValueError):
    def __init__(self, rid: str) -> None:
        super().__init__(duplicate_rid_error(rid))


class OverloadedError(RuntimeError):
    """The fault injector turned the request away with a 503."""


# --- requests ----------------------------------------------------------------------------------------


class Outcome(enum.Enum):
    FINISHED = "finished"
    ABORTED = "aborted"
    DROPPED = "dropped"


class SimRequest:
    """One request's state, shared by the engine and the HTTP handler serving it."""

    __slots__ = (
        "admitted_s",
        "bad_token_id",
        "counted_from",
        "created_s",
        "end",
        "finish_after_next_step",
        "finish_reason",
        "finished_s",
        "internal",
        "num_retractions",
        "origin",
        "outcome",
        "plan",
        "produced",
        "prompt_ids",
        "prompt_tokens",
        "reported_prompt",
        "rid",
        "sample",
        "stop_at",
        "wake",
        "wake_every",
    )

    def __init__(
        self,
        rid: str,
        prompt_tokens: int,
        plan: OutputPlan,
        wake_every: int,
        fault: FaultDraw,
        *,
        internal: bool = False,
    ):
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self.plan = plan
        #: The plan's cursor after this request's tokens, and the ids it was sent (set by the engine):
        #: what a continuation of it goes on from.
        self.origin: PlanCursor | None = None
        self.prompt_ids: Sequence[int] = ()
        self.sample = 0
        self.wake_every = wake_every  # 0: wake only when the request ends
        self.internal = internal  # the /health probe: in no counter, stat or metric
        self.produced = 0
        self.counted_from = 0  # tokens produced before the last stats reset
        self.stop_at, self.end = _ending(len(plan.token_ids), fault)
        self.outcome: Outcome | None = None
        self.finish_reason: FinishReason | None = None
        #: Set by an abort of a running request: it ends so after one more decode step.
        self.finish_after_next_step: FinishReason | None = None
        self.bad_token_id: int | None = None
        self.reported_prompt = True  # an abort in the waiting queue has no prompt_tokens in its meta_info
        self.num_retractions = 0
        self.created_s = time.monotonic()
        self.admitted_s: float | None = None
        self.finished_s: float | None = None
        self.wake = asyncio.Event()

    @property
    def done(self) -> bool:
        return self.outcome is not None

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_s is None else self.finished_s - self.created_s

    def output_ids(self, start: int = 0) -> tuple[int, ...]:
        return self.plan.token_ids[start : self.produced]

    def is_boundary(self, produced: int) -> bool:
        """A streamed chunk is due: the first token at once, then every ``wake_every`` tokens."""
        return bool(self.wake_every) and (produced - 1) % self.wake_every == 0

    async def wait(self) -> None:
        """Until the next stream boundary or the end, whichever comes first."""
        await self.wake.wait()
        self.wake.clear()


def _ending(planned: int, fault: FaultDraw) -> tuple[int, Fault]:
    """After how many tokens the engine ends the request, and how."""
    if fault.kind in (Fault.DROP, Fault.ABORT):
        return min(int(fault.at_fraction * planned), max(planned - 1, 0)), fault.kind
    return planned, Fault.NONE


@dataclass
class _Counters:
    generated_tokens: int = 0
    prompt_tokens: int = 0
    requests: int = 0
    rejected: int = 0
    finished: int = 0
    aborted: int = 0
    disconnected: int = 0
    errors_503: int = 0
    dropped: int = 0


# --- the engine --------------------------------------------------------------------------------------


class SimEngine:
    """The scheduler: a waiting queue, a running batch and the step loop. Use from one event loop.

    ``on_crash`` is called with the log line when an input id outside the vocabulary kills the engine
    (as it kills a real SGLang server): every request in flight is dropped and nothing runs any more.
    """

    def __init__(self, config: SimConfig, on_crash: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.on_crash = on_crash
        self.stopping = False
        self.crashed: str | None = None
        self._waiting: dict[str, SimRequest] = {}  # insertion order is the FIFO
        self._running: dict[str, SimRequest] = {}
        self._fault_rng = random.Random(config.seed)
        self._counters = _Counters()
        self._tokens_by_rid: dict[str, int] = {}  # retired requests only; running ones are added live
        #: Requests taken from the waiting queue into the running batch (prefilled), by rid prefix.
        self._started_by_prefix: dict[str, int] = {}
        #: ``/generate`` requests received, by rid prefix.
        self._requests_by_prefix: dict[str, int] = {}
        self._stats_prefix_len = 8
        #: digest of a prompt + output of a request that ended at its max_new_tokens -> its plan's cursor.
        self._continuations: OrderedDict[bytes, PlanCursor] = OrderedDict()
        self._work = asyncio.Event()
        self._stepped = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._last_step_s: float | None = None
        self.last_gen_throughput = 0.0
        # The server's own counters (/metrics): never reset, unlike the stats.
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        #: ``config.request_log``, opened at the first request that ends (a knob no update changes).
        self._request_log: IO[bytes] | None = None

    # lifecycle

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="tokenfleet-sim-steps")

    async def stop(self) -> None:
        """Abort everything in flight at once (so handlers answer) and end the step loop."""
        self.stopping = True
        for request in self._live():
            self._abort_now(request)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._request_log is not None:
            self._request_log.close()
            self._request_log = None

    # requests

    def note_received(self, rid: object = None) -> None:
        """A ``/generate`` arrived (``rid``: its rid, counted by prefix too when it is a string)."""
        self._counters.requests += 1
        if isinstance(rid, str):
            key = rid[: self._stats_prefix_len]
            self._requests_by_prefix[key] = self._requests_by_prefix.get(key, 0) + 1

    def note_rejected(self) -> None:
        self._counters.rejected += 1

    def is_live(self, rid: str) -> bool:
        return rid in self._waiting or rid in self._running

    def submit(
        self,
        rid: str,
        prompt_ids: Sequence[int],
        sampling: SamplingSpec,
        stream_interval: int | None,
        *,
        sample: int = 0,
        internal: bool = False,
        fail_after_first_token: FinishReason | None = None,
    ) -> SimRequest:
        """Queue a request; ``stream_interval`` None means the caller only wants the end."""
        if self.is_live(rid):
            raise DuplicateRequestError(rid)
        fault = FaultDraw(Fault.NONE, 0.0) if internal else draw_fault(self._fault_rng, self.config)
        if fault.kind is Fault.ERROR_503:
            self._counters.errors_503 += 1
            raise OverloadedError(QUEUE_FULL_MESSAGE)
        digest = prompt_digest(prompt_ids, sample)
        cursor = self._continuations.get(digest)
        if cursor is None:
            cursor = PlanCursor(random.Random(digest[8:]), wanted_length(digest, self.config))
        else:
            self._continuations.move_to_end(digest)
        plan, after = _plan(cursor, sampling, self.config)
        request = SimRequest(rid, len(prompt_ids), plan, stream_interval or 0, fault, internal=internal)
        request.origin, request.prompt_ids, request.sample = after, prompt_ids, sample
        request.bad_token_id = first_bad_token(prompt_ids, self.config.vocab_size)
        request.finish_after_next_step = fail_after_first_token
        config = self.config
        if request.prompt_tokens >= config.max_req_input_len:
            error = input_too_long_error(request.prompt_tokens, config.max_req_input_len)
            self._retire(request, Outcome.ABORTED, bad_request_abort(error))
            return request
        if config.max_queued_requests is not None and len(self._waiting) + 1 > config.max_queued_requests:
            self._retire(request, Outcome.ABORTED, shed_abort(QUEUE_FULL_MESSAGE))
            return request
        self._waiting[rid] = request
        self._work.set()
        return request

    def abort(self, rid: str | None = None, *, abort_all: bool = False) -> int:
        """SGLang's ``/abort_request``: only the exact rid of a live request aborts anything; then that one
        and every live request whose rid starts with it. A running request ends after one more decode
        step ("Aborted"), a waiting one at once ("Abort in waiting queue"). Returns how many."""
        if abort_all:
            matched = self._live()
        elif rid and self.is_live(rid):
            matched = [request for request in self._live() if request.rid.startswith(rid)]
        else:
            return 0
        for request in matched:
            if request.rid in self._waiting:
                request.reported_prompt = False
                self._retire(request, Outcome.ABORTED, abort_reason(ABORT_MESSAGE_WAITING_QUEUE))
            elif request.finish_after_next_step is None:
                request.finish_after_next_step = abort_reason(ABORT_MESSAGE_REQUESTED)
        return len(matched)

    def cancel(self, request: SimRequest) -> None:
        """The client went away: stop generating for it at once. No-op once the request has ended."""
        if not request.done:
            if not request.internal:
                self._counters.disconnected += 1
            self._abort_now(request)

    async def wait_for_step(self) -> None:
        """Until the engine next runs a decode step (the health check's sign of life)."""
        self._stepped.clear()
        await self._stepped.wait()

    # observation

    def totals(self) -> dict[str, Any]:
        """The counters alone: what ``stats`` gives less its maps by rid prefix, whose cost grows with every
        request served (a client whose rids share no prefix adds an entry per request to each)."""
        return {
            **dataclasses.asdict(self._counters),
            "running": self.num_running,
            "waiting": self.num_waiting,
        }

    def stats(self, prefix_len: int = 8) -> dict[str, Any]:
        by_prefix: dict[str, int] = {}
        for rid, tokens in self._tokens_by_rid.items():
            by_prefix[rid[:prefix_len]] = by_prefix.get(rid[:prefix_len], 0) + tokens
        for request in self._running.values():
            tokens = request.produced - request.counted_from
            if tokens and not request.internal:
                key = request.rid[:prefix_len]
                by_prefix[key] = by_prefix.get(key, 0) + tokens
        return {
            **self.totals(),
            "by_prefix": by_prefix,
            "started_by_prefix": dict(self._started_by_prefix),
            "requests_by_prefix": dict(self._requests_by_prefix),
        }

    @property
    def num_running(self) -> int:
        return sum(not r.internal for r in self._running.values())

    @property
    def num_waiting(self) -> int:
        return sum(not r.internal for r in self._waiting.values())

    def reset_stats(self) -> None:
        """Zero the counters and reseed the fault decisions, so a new run repeats the same faults."""
        self._counters = _Counters()
        self._tokens_by_rid.clear()
        self._started_by_prefix.clear()
        self._requests_by_prefix.clear()
        self._fault_rng = random.Random(self.config.seed)
        for request in self._running.values():
            request.counted_from = request.produced

    def loads(self) -> list[dict[str, int]]:
        """``/v1/loads``: one entry per data-parallel rank (the sim's one batch is reported on rank 0)."""
        busy = {
            "num_reqs": len(self._running) + len(self._waiting),
            "num_waiting_reqs": len(self._waiting),
            "num_tokens": sum(r.prompt_tokens + r.produced for r in self._running.values()),
        }
        idle = dict.fromkeys(busy, 0)
        return [{"dp_rank": rank} | (busy if rank == 0 else idle) for rank in range(self.config.dp_size)]

    def kv_tokens_in_use(self) -> int:
        return sum(r.prompt_tokens + r.produced for r in self._running.values())

    def update_config(self, changes: Mapping[str, Any]) -> SimConfig:
        self.config = updated_config(self.config, changes)
        return self.config

    # the step loop

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        while self.crashed is None:
            if not (self._running or self._waiting):
                self._work.clear()
                await self._work.wait()
                deadline = loop.time()
            step_s = self.config.step_time_s + self.config.step_time_per_request_s * len(self._running)
            deadline += step_s
            now = loop.time()
            if deadline < now - step_s:
                deadline = now  # far behind (an overloaded host): run late rather than in a burst
            await asyncio.sleep(max(0.0, deadline - now))
            if self.config.wedged:  # the GPU hangs: nothing is admitted, nothing decoded
                continue
            self._shed_timed_out()
            self._admit()
            if self.crashed is None:
                self._decode_step()

    def _shed_timed_out(self) -> None:
        waiting_s, running_s = self.config.req_waiting_timeout_s, self.config.req_running_timeout_s
        if waiting_s is None and running_s is None:
            return
        now = time.monotonic()
        for request in self._live():
            if request.admitted_s is None:
                limit, since, message = waiting_s, request.created_s, WAITING_TIMEOUT_MESSAGE
            else:
                limit, since, message = running_s, request.admitted_s, RUNNING_TIMEOUT_MESSAGE
            if limit is not None and now - since > limit:
                self._retire(request, Outcome.ABORTED, shed_abort(message))

    def _admit(self) -> None:
        free = self.config.batch_size - len(self._running)
        while free > 0 and self._waiting:
            request = self._waiting.pop(next(iter(self._waiting)))
            if request.bad_token_id is not None:
                error = out_of_vocab_error(request.bad_token_id, self.config.vocab_size)
                if self.config.crash_on_bad_token_id:
                    self._retire(request, Outcome.DROPPED, None)
                    self._crash(error)
                    return
                self._retire(request, Outcome.ABORTED, bad_request_abort(error))
                continue
            request.admitted_s = time.monotonic()
            if not request.internal:
                key = request.rid[: self._stats_prefix_len]
                self._started_by_prefix[key] = self._started_by_prefix.get(key, 0) + 1
                self._counters.prompt_tokens += request.prompt_tokens
                self.prompt_tokens_total += request.prompt_tokens
            if request.stop_at == 0:
                self._end(request)
                continue
            self._running[request.rid] = request
            free -= 1

    def _decode_step(self) -> None:
        ended: list[tuple[SimRequest, FinishReason | None]] = []
        counted = 0
        for request in self._running.values():
            request.produced += 1
            counted += not request.internal
            if request.produced == request.stop_at:
                ended.append((request, None))
            elif request.finish_after_next_step is not None:
                ended.append((request, request.finish_after_next_step))
            elif request.is_boundary(request.produced):
                request.wake.set()
        self._counters.generated_tokens += counted
        self.generation_tokens_total += counted
        self._note_throughput(len(self._running))
        for request, abort in ended:
            if abort is None:
                self._end(request)
            else:
                self._retire(request, Outcome.ABORTED, abort)
        self._stepped.set()

    def _note_throughput(self, tokens: int) -> None:
        now = time.monotonic()
        if self._last_step_s is not None and now > self._last_step_s:
            self.last_gen_throughput = tokens / (now - self._last_step_s)
        self._last_step_s = now

    # endings

    def _live(self) -> list[SimRequest]:
        return [*self._waiting.values(), *self._running.values()]

    def _crash(self, error: str) -> None:
        """Die like the real scheduler: every request in flight is dropped, nothing runs any more."""
        self.crashed = error
        for request in self._live():
            self._retire(request, Outcome.DROPPED, None)
        if self.on_crash is not None:
            self.on_crash(error)

    def _end(self, request: SimRequest) -> None:
        if request.end is Fault.DROP:
            self._retire(request, Outcome.DROPPED, None)
        elif request.end is Fault.ABORT:
            # What a server-side abort looks like in SGLang: retracted under memory pressure, then
            # aborted from the waiting queue.
            request.num_retractions += 1
            self._retire(request, Outcome.ABORTED, abort_reason(ABORT_MESSAGE_WAITING_QUEUE))
        else:
            self._retire(request, Outcome.FINISHED, request.plan.finish_reason)
            self._remember_continuation(request)

    def _remember_continuation(self, request: SimRequest) -> None:
        """A request that ended at its max_new_tokens may be continued: a later request whose prompt is
        its prompt and output goes on with its plan."""
        after = request.origin
        if after is None or request.internal or request.plan.finish_reason.get("type") != FINISH_LENGTH:
            return
        key = prompt_digest([*request.prompt_ids, *request.output_ids()], request.sample)
        self._continuations[key] = after
        while len(self._continuations) > CONTINUATIONS_KEPT:
            self._continuations.popitem(last=False)

    def _abort_now(self, request: SimRequest) -> None:
        queued = request.rid in self._waiting
        message = ABORT_MESSAGE_WAITING_QUEUE if queued else ABORT_MESSAGE_REQUESTED
        request.reported_prompt = not queued
        self._retire(request, Outcome.ABORTED, abort_reason(message))

    def _retire(self, request: SimRequest, outcome: Outcome, finish_reason: FinishReason | None) -> None:
        self._waiting.pop(request.rid, None)
        self._running.pop(request.rid, None)
        request.outcome = outcome
        request.finish_reason = finish_reason
        request.finished_s = time.monotonic()
        if not request.internal:
            if self.config.request_log:
                self._log_request(self.config.request_log, request)
            setattr(self._counters, outcome.value, getattr(self._counters, outcome.value) + 1)
            tokens = request.produced - request.counted_from
            if tokens:
                self._tokens_by_rid[request.rid] = self._tokens_by_rid.get(request.rid, 0) + tokens
        request.wake.set()

    def _log_request(self, path: str, request: SimRequest) -> None:
        """One line of ``path`` (``--request-log``) for ``request``, which just ended."""
        if self._request_log is None:
            self._request_log = open(path, "ab")  # noqa: SIM115 (closed by stop)
        line = {
            "rid": request.rid,
            "arrived_s": round(request.created_s, 4),
            "started_s": None if request.admitted_s is None else round(request.admitted_s, 4),
            "ended_s": round(request.finished_s or 0.0, 4),
            "prompt_tokens": request.prompt_tokens,
            "completion_tokens": request.produced,
            "finish": (request.finish_reason or {}).get("type"),
        }
        self._request_log.write(orjson.dumps(line) + b"\n")
        self._request_log.flush()
