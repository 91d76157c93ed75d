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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from workers.sglang.protocol import (
    ABORT_MESSAGE_REQUESTED,
    ABORT_MESSAGE_WAITING_QUEUE,
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    SGLANG_DEFAULT_MAX_NEW_TOKENS,
    FinishReason,
    duplicate_rid_error,
)

#: Ids below this are special (pad, bos, eos) in the simulated vocabulary.
FIRST_REGULAR_TOKEN: Final = 3

#: Knobs ``POST /sim/config`` may change while the server runs.
RUNTIME_KNOBS: Final[frozenset[str]] = frozenset(
    {"error_rate", "drop_rate", "abort_rate", "step_time_s", "fixed_output_len", "output_len_mean"}
)


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class SimConfig:
    """Everything the simulator can be told; each field is also a CLI flag (``--step-time-s``)."""

    host: str = field(default="127.0.0.1", metadata=_help("address to listen on"))
    port: int = field(default=30000, metadata=_help("port to listen on; 0 picks a free one"))
    step_time_s: float = field(default=0.01, metadata=_help("one decode step for all running requests"))
    max_running_requests: int = field(
        default=256, metadata=_help("batch size; further requests wait in a FIFO queue")
    )
    context_length: int = field(default=8192, metadata=_help("model context length in tokens"))
    vocab_size: int = field(default=32000, metadata=_help("output token ids are below this"))
    eos_token_id: int = field(default=2, metadata=_help("token that ends a natural stop"))
    output_len_mean: float = field(
        default=200.0, metadata=_help("mean tokens a prompt wants before EOS (lognormal)")
    )
    output_len_sigma: float = field(default=0.6, metadata=_help("sigma of the lognormal output length"))
    fixed_output_len: int | None = field(
        default=None, metadata=_help("every prompt wants exactly this many tokens before EOS")
    )
    incremental_output: bool = field(
        default=False, metadata=_help("stream output_ids deltas (--incremental-streaming-output)")
    )
    omit_output_ids: bool = field(default=False, metadata=_help("answer like sglang 0.4: no output_ids"))
    error_rate: float = field(default=0.0, metadata=_help("fraction of /generate answered 503"))
    drop_rate: float = field(default=0.0, metadata=_help("fraction of requests whose connection is cut"))
    abort_rate: float = field(
        default=0.0, metadata=_help("fraction of requests the server aborts (retracted, then aborted)")
    )
    seed: int = field(default=0, metadata=_help("seed of the fault decisions"))
    model_path: str = field(default="tokenfleet-sim", metadata=_help("reported model path and name"))
    tokenizer_path: str | None = field(
        default=None, metadata=_help("reported tokenizer path (default: the model path)")
    )

    def __post_init__(self) -> None:
        _check_config(self)


def _check_config(config: SimConfig) -> None:
    problems = [
        *(
            f"{name} must be within [0, 1]"
            for name in ("error_rate", "drop_rate", "abort_rate")
            if not 0.0 <= getattr(config, name) <= 1.0
        ),
        *(
            f"{name} must be positive"
            for name in ("max_running_requests", "context_length", "output_len_mean")
            if getattr(config, name) <= 0
        ),
    ]
    if config.step_time_s < 0:
        problems.append("step_time_s must not be negative")
    if config.output_len_sigma < 0:
        problems.append("output_len_sigma must not be negative")
    if config.vocab_size <= FIRST_REGULAR_TOKEN + 1:
        problems.append(f"vocab_size must be above {FIRST_REGULAR_TOKEN + 1}")
    if config.fixed_output_len is not None and config.fixed_output_len < 0:
        problems.append("fixed_output_len must not be negative")
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


def _coerce_knob(name: str, value: Any) -> float | int | None:
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


def prompt_digest(prompt_ids: Sequence[int]) -> bytes:
    # Python's hash() is salted per process; the outputs must not change between runs or servers.
    return hashlib.blake2b(",".join(map(str, prompt_ids)).encode(), digest_size=16).digest()


def wanted_length(digest: bytes, config: SimConfig) -> int:
    """How many tokens the prompt wants before EOS."""
    if config.fixed_output_len is not None:
        return config.fixed_output_len
    sigma = config.output_len_sigma
    mu = math.log(config.output_len_mean) - sigma * sigma / 2  # so that the mean is output_len_mean
    return max(1, round(random.Random(digest[:8]).lognormvariate(mu, sigma)))


def plan_output(prompt_ids: Sequence[int], sampling: SamplingSpec, config: SimConfig) -> OutputPlan:
    digest = prompt_digest(prompt_ids)
    wanted = wanted_length(digest, config)
    # A separate stream for the tokens, so the length knobs never change which tokens come out.
    rng = random.Random(digest[8:])
    stops = not sampling.ignore_eos  # SGLang's ignore_eos disables stop_token_ids too
    tokens: list[int] = []
    for position in range(sampling.max_new_tokens):
        if stops and position == wanted:
            tokens.append(config.eos_token_id)
            return OutputPlan(tuple(tokens), stop_reason(config.eos_token_id))
        token = _draw_token(rng, config)
        tokens.append(token)
        if stops and token in sampling.stop_token_ids:
            return OutputPlan(tuple(tokens), stop_reason(token))
    return OutputPlan(tuple(tokens), length_reason(sampling.max_new_tokens))


def _draw_token(rng: random.Random, config: SimConfig) -> int:
    while True:
        token = rng.randrange(FIRST_REGULAR_TOKEN, config.vocab_size)
        if token != config.eos_token_id:
            return token


def stop_reason(matched: int) -> FinishReason:
    return {"type": FINISH_STOP, "matched": matched}


def length_reason(max_new_tokens: int) -> FinishReason:
    return {"type": FINISH_LENGTH, "length": max_new_tokens}


def abort_reason(message: str) -> FinishReason:
    return {"type": FINISH_ABORT, "message": message, "status_code": None, "err_type": None}


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
        "counted_from",
        "created_s",
        "end",
        "finish_reason",
        "finished_s",
        "num_retractions",
        "outcome",
        "plan",
        "produced",
        "prompt_tokens",
        "rid",
        "stop_at",
        "wake",
        "wake_every",
    )

    def __init__(self, rid: str, prompt_tokens: int, plan: OutputPlan, wake_every: int, fault: FaultDraw):
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self.plan = plan
        self.wake_every = wake_every  # 0: wake only when the request ends
        self.produced = 0
        self.counted_from = 0  # tokens produced before the last stats reset
        self.stop_at, self.end = _ending(len(plan.token_ids), fault)
        self.outcome: Outcome | None = None
        self.finish_reason: FinishReason | None = None
        self.num_retractions = 0
        self.created_s = time.monotonic()
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
    requests: int = 0
    rejected: int = 0
    finished: int = 0
    aborted: int = 0
    disconnected: int = 0
    errors_503: int = 0
    dropped: int = 0


# --- the engine --------------------------------------------------------------------------------------


class SimEngine:
    """The scheduler: a waiting queue, a running batch and the step loop. Use from one event loop."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.stopping = False
        self._waiting: dict[str, SimRequest] = {}  # insertion order is the FIFO
        self._running: dict[str, SimRequest] = {}
        self._fault_rng = random.Random(config.seed)
        self._counters = _Counters()
        self._tokens_by_rid: dict[str, int] = {}  # retired requests only; running ones are added live
        self._work = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._last_step_s: float | None = None
        self.last_gen_throughput = 0.0

    # lifecycle

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="tokenfleet-sim-steps")

    async def stop(self) -> None:
        """Abort everything in flight (so handlers answer at once) and end the step loop."""
        self.stopping = True
        self.abort(abort_all=True)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # requests

    def note_received(self) -> None:
        self._counters.requests += 1

    def note_rejected(self) -> None:
        self._counters.rejected += 1

    def submit(
        self, rid: str, prompt_ids: Sequence[int], sampling: SamplingSpec, stream_interval: int | None
    ) -> SimRequest:
        """Queue a request; ``stream_interval`` None means the caller only wants the end."""
        if rid in self._waiting or rid in self._running:
            raise DuplicateRequestError(rid)
        fault = draw_fault(self._fault_rng, self.config)
        if fault.kind is Fault.ERROR_503:
            self._counters.errors_503 += 1
            raise OverloadedError("The request queue is full.")
        plan = plan_output(prompt_ids, sampling, self.config)
        request = SimRequest(rid, len(prompt_ids), plan, stream_interval or 0, fault)
        self._waiting[rid] = request
        self._work.set()
        return request

    def abort(self, rid_prefix: str | None = None, *, abort_all: bool = False) -> int:
        """Abort every queued or running request whose rid starts with ``rid_prefix`` (as SGLang does)."""
        if not abort_all and not rid_prefix:
            return 0
        matched = [
            request
            for queue in (self._waiting, self._running)
            for request in queue.values()
            if abort_all or request.rid.startswith(rid_prefix or "")
        ]
        for request in matched:
            self._abort(request)
        return len(matched)

    def cancel(self, request: SimRequest) -> None:
        """The client went away: stop generating for it. No-op once the request has ended."""
        if not request.done:
            self._counters.disconnected += 1
            self._abort(request)

    # observation

    def stats(self, prefix_len: int = 8) -> dict[str, Any]:
        by_prefix: dict[str, int] = {}
        for rid, tokens in self._tokens_by_rid.items():
            by_prefix[rid[:prefix_len]] = by_prefix.get(rid[:prefix_len], 0) + tokens
        for request in self._running.values():
            tokens = request.produced - request.counted_from
            if tokens:
                key = request.rid[:prefix_len]
                by_prefix[key] = by_prefix.get(key, 0) + tokens
        return {
            **dataclasses.asdict(self._counters),
            "running": len(self._running),
            "waiting": len(self._waiting),
            "by_prefix": by_prefix,
        }

    def reset_stats(self) -> None:
        """Zero the counters and reseed the fault decisions, so a new run repeats the same faults."""
        self._counters = _Counters()
        self._tokens_by_rid.clear()
        self._fault_rng = random.Random(self.config.seed)
        for request in self._running.values():
            request.counted_from = request.produced

    def load(self) -> dict[str, int]:
        return {
            "dp_rank": 0,
            "num_reqs": len(self._running) + len(self._waiting),
            "num_waiting_reqs": len(self._waiting),
            "num_tokens": sum(r.prompt_tokens + r.produced for r in self._running.values()),
        }

    def update_config(self, changes: Mapping[str, Any]) -> SimConfig:
        self.config = updated_config(self.config, changes)
        return self.config

    # the step loop

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        while True:
            if not (self._running or self._waiting):
                self._work.clear()
                await self._work.wait()
                deadline = loop.time()
            step_s = self.config.step_time_s
            deadline += step_s
            now = loop.time()
            if deadline < now - step_s:
                deadline = now  # far behind (an overloaded host): run late rather than in a burst
            await asyncio.sleep(max(0.0, deadline - now))
            self._admit()
            self._decode_step()

    def _admit(self) -> None:
        free = self.config.max_running_requests - len(self._running)
        while free > 0 and self._waiting:
            request = self._waiting.pop(next(iter(self._waiting)))
            if request.stop_at == 0:
                self._end(request)
                continue
            self._running[request.rid] = request
            free -= 1

    def _decode_step(self) -> None:
        ended: list[SimRequest] = []
        for request in self._running.values():
            request.produced += 1
            if request.produced == request.stop_at:
                ended.append(request)
            elif request.wake_every and request.produced % request.wake_every == 0:
                request.wake.set()
        self._counters.generated_tokens += len(self._running)
        self._note_throughput(len(self._running))
        for request in ended:
            self._end(request)

    def _note_throughput(self, tokens: int) -> None:
        now = time.monotonic()
        if self._last_step_s is not None and now > self._last_step_s:
            self.last_gen_throughput = tokens / (now - self._last_step_s)
        self._last_step_s = now

    # endings

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

    def _abort(self, request: SimRequest) -> None:
        queued = request.rid in self._waiting
        message = ABORT_MESSAGE_WAITING_QUEUE if queued else ABORT_MESSAGE_REQUESTED
        self._retire(request, Outcome.ABORTED, abort_reason(message))

    def _retire(self, request: SimRequest, outcome: Outcome, finish_reason: FinishReason | None) -> None:
        self._waiting.pop(request.rid, None)
        self._running.pop(request.rid, None)
        request.outcome = outcome
        request.finish_reason = finish_reason
        request.finished_s = time.monotonic()
        setattr(self._counters, outcome.value, getattr(self._counters, outcome.value) + 1)
        tokens = request.produced - request.counted_from
        if tokens:
            self._tokens_by_rid[request.rid] = self._tokens_by_rid.get(request.rid, 0) + tokens
        request.wake.set()
