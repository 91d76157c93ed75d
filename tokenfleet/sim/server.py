"""The simulator's HTTP face: SGLang's native routes over aiohttp, a thread runner and the CLI."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import logging
import math
import re
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
import typing
import urllib.error
import urllib.request
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from types import TracebackType
from typing import Any, Final

import orjson
from aiohttp import web

from tokenfleet.sim.engine import (
    MODEL_CONTEXT_LENGTH,
    Outcome,
    OverloadedError,
    SamplingSpec,
    SimConfig,
    SimEngine,
    SimRequest,
    bad_request_abort,
    detokenize,
    reasoning_length,
    tokenize,
)
from workers.sglang.protocol import (
    ABORT_PATH,
    EMPTY_INPUT_IDS_ERROR,
    FINISH_STOP,
    GENERATE_PATH,
    GET_SERVER_INFO_PATH,
    HEALTH_CHECK_RID_PREFIX,
    HEALTH_GENERATE_PATH,
    HEALTH_PATH,
    LOADS_PATH,
    METRICS_PATH,
    MISSING_PROMPT_ERROR,
    MODEL_INFO_PATH,
    MODELS_PATH,
    OPEN_PATH_PREFIXES,
    PING_PATH,
    READY_PATH,
    SERVER_INFO_PATH,
    SGLANG_DEFAULT_MAX_NEW_TOKENS,
    SSE_DATA_PREFIX,
    SSE_DONE,
    TOKENIZE_PATH,
    UNAUTHORIZED_BODY,
    context_length_error,
    context_overflow_error,
    duplicate_rid_error,
    overloaded_error_body,
    sampling_param_server_error,
    stream_error_chunk,
)

ENGINE_KEY: Final = web.AppKey("tokenfleet_sim_engine", SimEngine)
MODEL_DIR_KEY: Final = web.AppKey("tokenfleet_sim_model_dir", str)

SIM_VERSION: Final = "0.5.23-sim"
WEIGHT_VERSION: Final = "default"
DEFAULT_STATS_PREFIX_LEN: Final = 8
SHUTDOWN_TIMEOUT_S: Final = 2.0
#: Connections waiting to be accepted: uvicorn's default, which SGLang keeps.
LISTEN_BACKLOG: Final = 2048
SSE_HEADERS: Final = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
SSE_END: Final = b"\n\n"
SSE_DONE_EVENT: Final = SSE_DATA_PREFIX + SSE_DONE + SSE_END
#: The folder name of the model the sim writes when no --model-path is given.
SIM_MODEL_NAME: Final = "tokenfleet-sim"
#: Routes only the admin key opens when --admin-api-key is set (else the api key).
ADMIN_PATHS: Final = (ABORT_PATH, "/sim/")
PROMETHEUS_CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

log = logging.getLogger("tokenfleet.sim")


# --- parsing /generate -------------------------------------------------------------------------------


class BadRequest(Exception):
    """A 400 with SGLang's body for it."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(str(body))
        self.body = body


def schema_error(text: str) -> BadRequest:
    """Request validation errors: ``{"error": "<text>"}``."""
    return BadRequest({"error": text})


def value_error(message: str) -> BadRequest:
    """Errors SGLang raises as ValueError while tokenizing: ``{"error": {"message": ...}}``."""
    return BadRequest({"error": {"message": message}})


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingSpec
    stream: bool
    stream_interval: int
    #: How many outputs (``n`` or ``beam_width``): above 1, a batch with sub-rids ``f"{rid}_{i}"``.
    samples: int = 1
    #: Why the tokenizer refuses it (too long for the context): a 400, or an error chunk when streaming.
    refusal: str | None = None
    #: A bad ``stop_regex``: the scheduler aborts the request with a 400 after its first token.
    stop_regex_error: str | None = None

    @property
    def rids(self) -> list[str]:
        return [self.rid] if self.samples == 1 else [f"{self.rid}_{i}" for i in range(self.samples)]


def parse_generate(body: Any, config: SimConfig) -> GenerateRequest:
    if not isinstance(body, dict):
        raise schema_error("the request body must be a JSON object")
    params = _parse_sampling_object(body.get("sampling_params"))
    prompt_ids = _parse_prompt(body, config.vocab_size)
    sampling = SamplingSpec(
        max_new_tokens=_int_param(params, "max_new_tokens", SGLANG_DEFAULT_MAX_NEW_TOKENS, minimum=0),
        ignore_eos=bool(params.get("ignore_eos")),
        stop_token_ids=frozenset(params.get("stop_token_ids") or ()),
    )
    samples = max(_int_param(params, "n", 1, minimum=1), _int_param(params, "beam_width", 1, minimum=1))
    return GenerateRequest(
        rid=_parse_rid(body.get("rid")),
        prompt_ids=prompt_ids,
        sampling=sampling,
        stream=_bool_field(body, "stream"),
        stream_interval=_int_param(params, "stream_interval", config.stream_interval, minimum=1),
        samples=samples,
        refusal=_context_refusal(len(prompt_ids), sampling.max_new_tokens, config.effective_context_length),
        stop_regex_error=_stop_regex_error(params.get("stop_regex")),
    )


def _batch_error() -> BadRequest:
    return schema_error("tokenfleet sim serves single prompts only, not batches of prompts")


def _parse_prompt(body: dict[str, Any], vocab_size: int) -> list[int]:
    input_ids, text = body.get("input_ids"), body.get("text")
    if input_ids is not None:
        return _parse_input_ids(input_ids)
    if text is None:
        raise value_error(MISSING_PROMPT_ERROR)
    if isinstance(text, list):
        raise _batch_error()
    if not isinstance(text, str):
        raise schema_error("`text` must be a string")
    return tokenize(text, vocab_size)


def _parse_input_ids(input_ids: Any) -> list[int]:
    if not isinstance(input_ids, list):
        raise schema_error("`input_ids` must be a list of integers")
    if not input_ids:
        raise BadRequest({"error": {"message": EMPTY_INPUT_IDS_ERROR}})
    if isinstance(input_ids[0], list):
        raise _batch_error()
    if not all(_is_int(token) for token in input_ids):
        raise schema_error("`input_ids` must be a list of integers")
    # Ids outside the vocabulary pass here, as in SGLang: the scheduler dies of them (SimEngine).
    return input_ids


def _parse_sampling_object(params: Any) -> dict[str, Any]:
    if params is None:
        return {}
    if isinstance(params, list):
        raise _batch_error()
    if not isinstance(params, dict):
        raise schema_error("`sampling_params` must be an object")
    error = sampling_param_server_error(params)
    if error:
        raise schema_error(error)
    return params


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_param(params: dict[str, Any], key: str, default: int, *, minimum: int) -> int:
    value = params.get(key)  # of the right type already (sampling_param_server_error)
    if value is None:
        return default
    if value < minimum:
        raise value_error(f"{key} must be at least {minimum}, got {value}.")
    return int(value)


def _bool_field(params: dict[str, Any], key: str) -> bool:
    value = params.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise schema_error(f"`{key}` must be a boolean")
    return value


def _stop_regex_error(value: Any) -> str | None:
    for pattern in [value] if isinstance(value, str) else value or []:
        try:
            re.compile(pattern)
        except re.error as exc:
            return f"invalid stop_regex {pattern!r}: {exc}"
    return None


def _context_refusal(prompt_tokens: int, max_new_tokens: int, context_length: int) -> str | None:
    if prompt_tokens >= context_length:
        return context_length_error(prompt_tokens, context_length)
    if prompt_tokens + max_new_tokens > context_length:
        return context_overflow_error(prompt_tokens, max_new_tokens, context_length)
    return None


def _parse_rid(rid: Any) -> str:
    if rid is None:
        return uuid.uuid4().hex
    if isinstance(rid, list):
        raise _batch_error()
    if not isinstance(rid, str):
        raise schema_error("`rid` must be a string")
    return rid


# --- rendering responses -----------------------------------------------------------------------------


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def meta_info(
    request: SimRequest, completion_tokens: int, *, first: bool, final: bool, reasoning_tokens: int = 0
) -> dict[str, Any]:
    meta: dict[str, Any] = {"id": request.rid, "finish_reason": request.finish_reason if final else None}
    if request.reported_prompt:
        meta["prompt_tokens"] = request.prompt_tokens
    meta |= {
        "completion_tokens": completion_tokens,
        "cached_tokens": 0,
        "cached_tokens_details": None,
        "weight_version": WEIGHT_VERSION,
        "num_retractions": request.num_retractions,
        "reasoning_tokens": reasoning_tokens,
        "dp_rank": 0,
    }
    if first:
        meta["response_sent_to_client_ts"] = time.time()
    if final:
        meta["weight_versions"] = [WEIGHT_VERSION]
        meta["e2e_latency"] = request.e2e_latency
    return meta


class Renderer:
    """Builds the bodies of one request; keeps the text decoded so far, so streaming stays linear."""

    def __init__(self, request: SimRequest, config: SimConfig, index: int | None = None) -> None:
        self.request = request
        self.index = index  # the sample's place in an n > 1 batch
        self.incremental = config.incremental_streaming_output
        self.omit_output_ids = config.omit_output_ids
        self.sent = 0  # output tokens already sent
        self.chunks = 0
        self.finished = False  # the final chunk went out
        self.text = ""
        self.decoded = 0
        #: The plan's first tokens that are thinking (``--reasoning-fraction``).
        self.thinking = reasoning_length(request.plan, config)

    def body(self, upto: int, final: bool, *, streaming: bool = True) -> dict[str, Any]:
        request = self.request
        trim_stop = final and (request.finish_reason or {}).get("type") == FINISH_STOP
        visible = upto - 1 if trim_stop else upto  # output_ids keep the stop token, text does not
        delta = detokenize(request.plan.token_ids[self.decoded : visible])
        self.text += delta
        self.decoded = visible
        incremental = streaming and self.incremental
        body: dict[str, Any] = {"text": delta if incremental else self.text}
        if not self.omit_output_ids:
            start = self.sent if incremental else 0
            body["output_ids"] = request.plan.token_ids[start:upto]
        self.sent = upto
        body["meta_info"] = meta_info(
            request,
            upto,
            first=streaming and self.chunks == 0,
            final=final,
            reasoning_tokens=min(upto, self.thinking),
        )
        if self.index is not None:
            body["index"] = self.index
        self.chunks += 1
        self.finished = final
        return body

    def pending_events(self, interval: int) -> bytes:
        """SSE events for every boundary reached since the last call (the first token at once, then one
        every ``interval`` tokens), and the final one once the request ended."""
        request = self.request
        if self.finished:
            return b""
        produced = request.produced
        final = request.done and request.outcome is not Outcome.DROPPED
        first = 1 + math.ceil(self.sent / interval) * interval
        marks = list(range(first, produced + 1, interval))
        if final and (not marks or marks[-1] != produced):
            marks.append(produced)
        return b"".join(sse_event(self.body(upto, final and upto == produced)) for upto in marks)


def sse_event(body: dict[str, Any]) -> bytes:
    return SSE_DATA_PREFIX + orjson.dumps(body) + SSE_END


# --- /generate ---------------------------------------------------------------------------------------


async def read_json(request: web.Request) -> Any:
    try:
        return orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise schema_error(f"invalid JSON: {exc}") from exc


async def handle_generate(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    try:
        body = await read_json(request)
    except BadRequest as exc:
        engine.note_received(None)
        engine.note_rejected()
        return json_response(exc.body, status=400)
    engine.note_received(body.get("rid") if isinstance(body, dict) else None)
    try:
        parsed = parse_generate(body, engine.config)
    except BadRequest as exc:
        engine.note_rejected()
        return json_response(exc.body, status=400)
    refusal = parsed.refusal or next(
        (duplicate_rid_error(rid) for rid in parsed.rids if engine.is_live(rid)), None
    )
    if refusal is not None:
        # Refused by the tokenizer before the request runs: a streaming client already has its 200.
        engine.note_rejected()
        if parsed.stream:
            return await _stream_refusal(request, refusal)
        return json_response(value_error(refusal).body, status=400)
    try:
        sim_requests = _submit(engine, parsed)
    except OverloadedError as exc:
        return json_response(overloaded_error_body(str(exc)), status=503)
    try:
        if parsed.stream:
            return await _stream(request, sim_requests, engine.config, parsed.stream_interval)
        return await _answer_when_done(request, sim_requests, engine.config)
    finally:
        # Runs on cancellation too: a client that hangs up aborts its request, as SGLang does.
        for sim_request in sim_requests:
            engine.cancel(sim_request)


def _submit(engine: SimEngine, parsed: GenerateRequest) -> list[SimRequest]:
    interval = parsed.stream_interval if parsed.stream else None
    failure = bad_request_abort(parsed.stop_regex_error) if parsed.stop_regex_error else None
    submitted: list[SimRequest] = []
    try:
        for sample, rid in enumerate(parsed.rids):
            submitted.append(
                engine.submit(
                    rid,
                    parsed.prompt_ids,
                    parsed.sampling,
                    interval,
                    sample=sample,
                    fail_after_first_token=failure,
                )
            )
    except OverloadedError:
        for sim_request in submitted:
            engine.cancel(sim_request)
        raise
    if len(submitted) > 1:
        shared = asyncio.Event()  # one wake-up for the whole batch: its chunks interleave
        for sim_request in submitted:
            sim_request.wake = shared
    return submitted


async def _stream_refusal(request: web.Request, message: str) -> web.StreamResponse:
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    await response.write(sse_event(stream_error_chunk(message)) + SSE_DONE_EVENT)
    return response


async def _wait_all(sim_requests: list[SimRequest]) -> None:
    for sim_request in sim_requests:
        while not sim_request.done:
            await sim_request.wait()


async def _answer_when_done(
    request: web.Request, sim_requests: list[SimRequest], config: SimConfig
) -> web.StreamResponse:
    await _wait_all(sim_requests)
    if any(r.outcome is Outcome.DROPPED for r in sim_requests):
        return _cut_connection(request, web.Response())
    reason = sim_requests[0].finish_reason or {}
    if len(sim_requests) == 1 and reason.get("status_code") == HTTPStatus.SERVICE_UNAVAILABLE:
        return json_response(overloaded_error_body(str(reason.get("message"))), status=503)
    bodies = [
        Renderer(r, config, i if len(sim_requests) > 1 else None).body(r.produced, True, streaming=False)
        for i, r in enumerate(sim_requests)
    ]
    return json_response(bodies if len(bodies) > 1 else bodies[0])


async def _stream(
    request: web.Request, sim_requests: list[SimRequest], config: SimConfig, interval: int
) -> web.StreamResponse:
    response = web.StreamResponse(headers=SSE_HEADERS)
    batch = len(sim_requests) > 1
    renderers = [Renderer(r, config, i if batch else None) for i, r in enumerate(sim_requests)]
    try:
        await response.prepare(request)
        while True:
            # Read before rendering: a request may end while we write.
            ended = all(r.done for r in sim_requests)
            dropped = any(r.outcome is Outcome.DROPPED for r in sim_requests)
            if dropped:
                return _cut_connection(request, response)
            events = b"".join(renderer.pending_events(interval) for renderer in renderers)
            if events:
                await response.write(events)
            if ended:
                break
            await next(r for r in sim_requests if not r.done).wait()
        await response.write(SSE_DONE_EVENT)
    except ConnectionError:
        return response  # the client is gone; handle_generate aborts the request
    return response


def _cut_connection(request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
    """Simulate a network failure: close the socket without completing the response."""
    if request.transport is not None:
        request.transport.close()
    return response  # aiohttp finds the connection closed and drops the response quietly


# --- the other routes --------------------------------------------------------------------------------


async def handle_tokenize(request: web.Request) -> web.Response:
    """SGLang's ``/tokenize``: the ids ``/generate`` takes a ``text`` prompt as."""
    config = request.app[ENGINE_KEY].config
    try:
        body = await read_json(request)
    except BadRequest as exc:
        return json_response(exc.body, status=400)
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if not isinstance(prompt, str):
        return json_response(schema_error("`prompt` must be a string").body, status=400)
    tokens = tokenize(prompt, config.vocab_size)
    return json_response(
        {"tokens": tokens, "count": len(tokens), "max_model_len": config.effective_context_length}
    )


async def handle_abort(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    try:
        body = await read_json(request)
    except BadRequest as exc:
        return json_response(exc.body, status=400)
    if not isinstance(body, dict):
        return json_response(schema_error("the request body must be a JSON object").body, status=400)
    rid = body.get("rid")
    engine.abort(rid if isinstance(rid, str) else None, abort_all=body.get("abort_all") is True)
    return web.Response()


async def handle_health(request: web.Request) -> web.Response:
    """A 1-token generation through the engine; healthy once the engine shows a sign of life (a decode
    step) within ``health_check_timeout_s``, as SGLang's ``/health`` does."""
    engine = request.app[ENGINE_KEY]
    if engine.stopping or engine.crashed:
        return web.Response(status=503)
    if engine.config.wedged:  # a health check that does not reach the engine (the failure it cannot see)
        return web.Response(status=200)
    probe = engine.submit(
        f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}", [0], SamplingSpec(max_new_tokens=1), 1, internal=True
    )
    try:
        await asyncio.wait_for(engine.wait_for_step(), engine.config.health_check_timeout_s)
    except TimeoutError:
        log.error("Health check failed: no decode step in %s s", engine.config.health_check_timeout_s)
        return web.Response(status=503)
    finally:
        engine.cancel(probe)
    return web.Response(status=503 if engine.crashed else 200)


async def handle_ready(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return web.Response(status=503 if engine.stopping or engine.crashed else 200)


def _model_path(request: web.Request) -> str:
    return request.app[ENGINE_KEY].config.model_path or request.app[MODEL_DIR_KEY]


def _tokenizer_path(request: web.Request) -> str:
    return request.app[ENGINE_KEY].config.tokenizer_path or _model_path(request)


async def handle_model_info(request: web.Request) -> web.Response:
    return json_response(
        {
            "model_path": _model_path(request),
            "tokenizer_path": _tokenizer_path(request),
            "is_generation": True,
            "served_model_name": _model_path(request),
            "weight_version": WEIGHT_VERSION,
            "preferred_sampling_params": None,
        }
    )


async def handle_server_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    config = engine.config
    kv_pool = config.kv_pool_tokens
    state = {
        "effective_max_running_requests_per_dp": config.running_requests_per_dp,
        "last_gen_throughput": engine.last_gen_throughput,
        "memory_usage": {"weight": 0.0, "kvcache": 0.0, "token_capacity": kv_pool, "graph": 0.0},
    }
    return json_response(
        {
            **config.public(),
            # The launch arguments: null unless given (the batch in force is in internal_states).
            "max_running_requests": config.max_running_requests,
            "context_length": config.context_length,
            "port": request.url.port or config.port,
            "model_path": _model_path(request),
            "tokenizer_path": _tokenizer_path(request),
            "served_model_name": _model_path(request),
            "tp_size": 1,
            "max_total_num_tokens": kv_pool,
            "max_req_input_len": config.max_req_input_len,
            "version": SIM_VERSION,
            "internal_states": [dict(state) for _ in range(config.dp_size)],
        }
    )


async def handle_loads(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    loads = [
        {
            "dp_rank": load["dp_rank"],
            "num_running_reqs": load["num_reqs"] - load["num_waiting_reqs"],
            "num_waiting_reqs": load["num_waiting_reqs"],
            "num_used_tokens": load["num_tokens"],
            "max_total_num_tokens": engine.config.kv_pool_tokens // engine.config.dp_size,
        }
        for load in engine.loads()
    ]
    return json_response(
        {
            "timestamp": datetime.datetime.now(datetime.UTC).isoformat(),
            "version": SIM_VERSION,
            "accelerator": None,
            "num_accelerators": 0,
            "loads": loads,
        }
    )


async def handle_models(request: web.Request) -> web.Response:
    config = request.app[ENGINE_KEY].config
    name = _model_path(request)
    model = {
        "id": name,
        "object": "model",
        "owned_by": "sglang",
        "root": name,
        "max_model_len": config.effective_context_length,
    }
    return json_response({"object": "list", "data": [model]})


async def handle_metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if not engine.config.enable_metrics:
        raise web.HTTPNotFound()
    labels = f'model_name="{_model_path(request)}"'
    metrics = [
        (
            "sglang:prompt_tokens",
            "counter",
            "Number of prefill tokens processed.",
            engine.prompt_tokens_total,
        ),
        (
            "sglang:generation_tokens",
            "counter",
            "Number of generation tokens processed.",
            engine.generation_tokens_total,
        ),
        ("sglang:num_running_reqs", "gauge", "The number of running requests.", engine.num_running),
        (
            "sglang:num_queue_reqs",
            "gauge",
            "The number of requests in the waiting queue.",
            engine.num_waiting,
        ),
    ]
    lines = []
    for name, kind, help_text, value in metrics:
        sample = f"{name}_total" if kind == "counter" else name
        lines += [f"# HELP {sample} {help_text}", f"# TYPE {sample} {kind}", f"{sample}{{{labels}}} {value}"]
    return web.Response(text="\n".join(lines) + "\n", headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})


async def handle_sim_stats(request: web.Request) -> web.Response:
    if request.query.get("totals") == "1":  # cheap enough to read ten times a second in a long run
        return json_response(request.app[ENGINE_KEY].totals())
    raw = request.query.get("prefix_len", str(DEFAULT_STATS_PREFIX_LEN))
    if not raw.isdigit():
        return json_response(schema_error("prefix_len must be a non-negative integer").body, status=400)
    return json_response(request.app[ENGINE_KEY].stats(int(raw)))


async def handle_sim_reset(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    engine.reset_stats()
    return json_response(engine.stats())


async def handle_sim_config_get(request: web.Request) -> web.Response:
    return json_response(request.app[ENGINE_KEY].config.public())


async def handle_sim_config_post(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    try:
        changes = await read_json(request)
        if not isinstance(changes, dict):
            raise schema_error("the request body must be a JSON object")
        config = engine.update_config(changes)
    except BadRequest as exc:
        return json_response(exc.body, status=400)
    except ValueError as exc:
        return json_response(schema_error(str(exc)).body, status=400)
    return json_response(config.public())


# --- keys --------------------------------------------------------------------------------------------


def _bearer_matches(header: str | None, key: str) -> bool:
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), key.encode())


@web.middleware
async def check_api_key(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """SGLang's key check: ``/health*``, ``/ready*`` and ``/metrics*`` are open; the admin routes take only
    the admin key when one is set (else the api key); every other route takes the api key when one is
    set, whatever the admin key."""
    config = request.app[ENGINE_KEY].config
    path = request.path
    if request.method == "OPTIONS" or path.startswith(OPEN_PATH_PREFIXES):
        return await handler(request)
    admin = path.startswith(ADMIN_PATHS)
    key = config.admin_api_key if admin and config.admin_api_key else config.api_key
    if key and not _bearer_matches(request.headers.get("Authorization"), key):
        return json_response(UNAUTHORIZED_BODY, status=401)
    return await handler(request)


# --- the application ---------------------------------------------------------------------------------


def write_model_dir(config: SimConfig, parent: Path) -> Path:
    """A model folder as a real server is pointed at: its ``config.json`` names the vocabulary."""
    folder = parent / SIM_MODEL_NAME
    folder.mkdir()
    model_config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "max_position_embeddings": MODEL_CONTEXT_LENGTH,
        "bos_token_id": 1,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": 0,
    }
    (folder / "config.json").write_bytes(orjson.dumps(model_config, option=orjson.OPT_INDENT_2))
    return folder


def _crash_handler(app: web.Application) -> Callable[[str], None]:
    def crashed(error: str) -> None:
        # What the real scheduler prints before every process of the server exits.
        log.error("Scheduler hit an exception: Traceback (most recent call last):\n%s", error)
        print(f"Scheduler hit an exception: {error}", file=sys.stderr, flush=True)
        on_crash = app.get(CRASH_CALLBACK_KEY)
        if on_crash is not None:
            on_crash(error)

    return crashed


CrashCallback = Callable[[str], None]
CRASH_CALLBACK_KEY: Final[web.AppKey[CrashCallback]] = web.AppKey("tokenfleet_sim_on_crash")


async def _start_engine(app: web.Application) -> None:
    engine = app[ENGINE_KEY]
    if engine.config.model_path is None:
        app[MODEL_DIR_KEY] = str(
            write_model_dir(engine.config, Path(tempfile.mkdtemp(prefix="tokenfleet-sim-")))
        )
    else:
        app[MODEL_DIR_KEY] = engine.config.model_path
    await engine.start()


async def _stop_engine(app: web.Application) -> None:
    await app[ENGINE_KEY].stop()


async def _remove_model_dir(app: web.Application) -> None:
    if app[ENGINE_KEY].config.model_path is None and MODEL_DIR_KEY in app:
        shutil.rmtree(Path(app[MODEL_DIR_KEY]).parent, ignore_errors=True)


def build_app(
    config: SimConfig | None = None, on_crash: Callable[[str], None] | None = None
) -> web.Application:
    """The simulator's routes; ``on_crash`` is told when the engine dies (an input id outside the
    vocabulary), after every request in flight was dropped."""
    app = web.Application(middlewares=[check_api_key])
    engine = SimEngine(config or SimConfig())
    app[ENGINE_KEY] = engine
    if on_crash is not None:
        app[CRASH_CALLBACK_KEY] = on_crash
    engine.on_crash = _crash_handler(app)
    app.on_startup.append(_start_engine)
    app.on_shutdown.append(_stop_engine)
    app.on_cleanup.append(_remove_model_dir)
    app.add_routes(
        [
            web.post(GENERATE_PATH, handle_generate),
            web.post(ABORT_PATH, handle_abort),
            web.post(TOKENIZE_PATH, handle_tokenize),
            web.get(HEALTH_PATH, handle_health),
            web.get(HEALTH_GENERATE_PATH, handle_health),
            web.get(READY_PATH, handle_ready),
            web.get(PING_PATH, handle_ready),
            web.get(MODEL_INFO_PATH, handle_model_info),
            web.get("/get_model_info", handle_model_info),
            web.get(SERVER_INFO_PATH, handle_server_info),
            web.get(GET_SERVER_INFO_PATH, handle_server_info),
            web.get(LOADS_PATH, handle_loads),
            web.get(MODELS_PATH, handle_models),
            web.get(METRICS_PATH, handle_metrics),
            web.get("/sim/stats", handle_sim_stats),
            web.post("/sim/reset", handle_sim_reset),
            web.get("/sim/config", handle_sim_config_get),
            web.post("/sim/config", handle_sim_config_post),
        ]
    )
    return app


# --- serving -----------------------------------------------------------------------------------------


def http_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def serve(config: SimConfig, *, on_ready: Callable[[int], None], stop: asyncio.Event) -> str | None:
    """Serve until ``stop`` is set or the engine crashes; ``on_ready`` gets the bound port (useful with
    port 0). Returns the crash's error, or None after a clean stop."""
    crash: list[str] = []

    def crashed(error: str) -> None:
        crash.append(error)
        stop.set()

    runner = web.AppRunner(
        build_app(config, on_crash=crashed),
        handler_cancellation=True,  # so a client that hangs up cancels its handler at once
        access_log=None,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )
    await runner.setup()
    try:
        # SGLang 0.5.23 serves through uvicorn with its default listen backlog, 2,048
        # (sglang/srt/entrypoints/http_server.py); aiohttp's default is 128. With 128, a fleet opening a
        # thousand connections at once had most of its SYNs dropped and retried a second later
        # (TcpExtListenOverflows), a ramp the real server does not have.
        site = web.TCPSite(runner, config.host, config.port, backlog=LISTEN_BACKLOG)
        await site.start()
        on_ready(runner.addresses[0][1])
        await stop.wait()
    finally:
        await runner.cleanup()
    return crash[0] if crash else None


class SimServerThread:
    """The simulator on its own event loop in a daemon thread; for tests and in-process benchmarks."""

    def __init__(self, config: SimConfig | None = None, *, startup_timeout_s: float = 10.0) -> None:
        self.config = config or SimConfig(port=0)
        self.startup_timeout_s = startup_timeout_s
        self._port: int | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        #: The error the engine died of (an input id outside the vocabulary); the server is gone then.
        self.crashed: str | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the simulator is not running; call start() first")
        return self._port

    @property
    def url(self) -> str:
        wildcard = self.config.host in ("", "0.0.0.0", "::")
        return http_url("127.0.0.1" if wildcard else self.config.host, self.port)

    def start(self) -> SimServerThread:
        self._thread = threading.Thread(target=self._run, name="tokenfleet-sim", daemon=True)
        self._thread.start()
        if not self._ready.wait(self.startup_timeout_s):
            raise RuntimeError(f"the simulator did not start within {self.startup_timeout_s} s")
        if self._error is not None:
            raise RuntimeError(f"the simulator failed to start: {self._error}") from self._error
        self._wait_until_healthy()
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop_event is not None and not self._loop.is_closed():
            # RuntimeError: the loop closed meanwhile, so there is nothing left to stop.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop_event.set)
        if self._thread is not None:
            self._thread.join(self.startup_timeout_s + SHUTDOWN_TIMEOUT_S)
            self._thread = None

    def __enter__(self) -> SimServerThread:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:
            self._error = exc
        finally:
            self._ready.set()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _serve(self) -> None:
        self._stop_event = asyncio.Event()
        self.crashed = await serve(self.config, on_ready=self._on_ready, stop=self._stop_event)

    def _on_ready(self, port: int) -> None:
        self._port = port
        self._ready.set()

    def _wait_until_healthy(self) -> None:
        try:
            with urllib.request.urlopen(self.url + HEALTH_PATH, timeout=self.startup_timeout_s) as reply:
                reply.read()
        except (urllib.error.URLError, OSError) as exc:
            self.stop()
            raise RuntimeError(f"the simulator at {self.url} does not answer: {exc}") from exc


# --- the command line --------------------------------------------------------------------------------


def _optional_int(text: str) -> int | None:
    return None if text.lower() in ("", "none") else int(text)


def _optional_float(text: str) -> float | None:
    return None if text.lower() in ("", "none") else float(text)


def _optional_str(text: str) -> str | None:
    return None if text.lower() in ("", "none") else text


_ARG_TYPES: Final[dict[Any, Callable[[str], Any]]] = {
    int: int,
    float: float,
    str: str,
    int | None: _optional_int,
    float | None: _optional_float,
    str | None: _optional_str,
}


def build_parser() -> argparse.ArgumentParser:
    """One flag per SimConfig field, so the two cannot drift apart."""
    parser = argparse.ArgumentParser(
        prog="tokenfleet sim", description="Simulate an SGLang server speaking the native /generate API."
    )
    hints = typing.get_type_hints(SimConfig)
    for config_field in dataclasses.fields(SimConfig):
        flag = "--" + config_field.name.replace("_", "-")
        help_text = config_field.metadata.get("help", "")
        if "default" not in help_text:
            help_text += " (default: %(default)s)"
        kind = hints[config_field.name]
        if kind is bool:
            action = argparse.BooleanOptionalAction
            parser.add_argument(flag, action=action, default=config_field.default, help=help_text)
        else:
            parser.add_argument(flag, type=_ARG_TYPES[kind], default=config_field.default, help=help_text)
    return parser


def parse_config(argv: Sequence[str] | None = None) -> SimConfig:
    parser = build_parser()
    namespace = parser.parse_args(argv)
    try:
        return SimConfig(**vars(namespace))
    except ValueError as exc:
        parser.error(str(exc))


async def _serve_until_signalled(config: SimConfig) -> str | None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)

    def announce(port: int) -> None:
        print(f"tokenfleet sim listening on {http_url(config.host, port)}", flush=True)

    return await serve(config, on_ready=announce, stop=stop)


def main(argv: Sequence[str] | None = None) -> int:
    """``tokenfleet sim``: serve until SIGINT or SIGTERM (exit 0), or until an input id outside the
    vocabulary kills it, as it kills a real SGLang server (exit 1)."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    crashed = asyncio.run(_serve_until_signalled(parse_config(argv)))
    return 1 if crashed else 0
