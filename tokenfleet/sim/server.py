"""The simulator's HTTP face: SGLang's native routes over aiohttp, a thread runner and the CLI."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import signal
import threading
import typing
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final

import orjson
from aiohttp import web

from tokenfleet.sim.engine import (
    DuplicateRequestError,
    Outcome,
    OverloadedError,
    SamplingSpec,
    SimConfig,
    SimEngine,
    SimRequest,
    detokenize,
    tokenize,
)
from workers.sglang.protocol import (
    ABORT_PATH,
    FINISH_STOP,
    GENERATE_PATH,
    GET_LOAD_PATH,
    HEALTH_GENERATE_PATH,
    HEALTH_PATH,
    MISSING_PROMPT_ERROR,
    MODEL_INFO_PATH,
    MODELS_PATH,
    SERVER_INFO_PATH,
    SGLANG_DEFAULT_MAX_NEW_TOKENS,
    SSE_DATA_PREFIX,
    SSE_DONE,
    context_length_error,
    context_overflow_error,
    overloaded_error_body,
    unknown_sampling_key_error,
    unknown_sampling_keys,
)

ENGINE_KEY: Final = web.AppKey("tokenfleet_sim_engine", SimEngine)

SIM_VERSION: Final = "0.5.23-sim"
WEIGHT_VERSION: Final = "default"
DEFAULT_STATS_PREFIX_LEN: Final = 8
SHUTDOWN_TIMEOUT_S: Final = 2.0
SSE_HEADERS: Final = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
SSE_END: Final = b"\n\n"
SSE_DONE_EVENT: Final = SSE_DATA_PREFIX + SSE_DONE + SSE_END


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


def parse_generate(body: Any, config: SimConfig) -> GenerateRequest:
    if not isinstance(body, dict):
        raise schema_error("the request body must be a JSON object")
    prompt_ids = _parse_prompt(body, config.vocab_size)
    params = _parse_sampling_object(body.get("sampling_params"))
    sampling = SamplingSpec(
        max_new_tokens=_int_param(params, "max_new_tokens", SGLANG_DEFAULT_MAX_NEW_TOKENS, minimum=0),
        ignore_eos=_bool_field(params, "ignore_eos"),
        stop_token_ids=_stop_token_ids(params.get("stop_token_ids")),
    )
    _check_context(len(prompt_ids), sampling.max_new_tokens, config.context_length)
    return GenerateRequest(
        rid=_parse_rid(body.get("rid")),
        prompt_ids=prompt_ids,
        sampling=sampling,
        stream=_bool_field(body, "stream"),
        stream_interval=_int_param(params, "stream_interval", 1, minimum=1),
    )


def _batch_error() -> BadRequest:
    return schema_error("tokenfleet sim serves single requests only, not batches")


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
    if input_ids and isinstance(input_ids[0], list):
        raise _batch_error()
    if not all(_is_int(token) and token >= 0 for token in input_ids):
        raise schema_error("`input_ids` must be a list of non-negative integers")
    return input_ids


def _parse_sampling_object(params: Any) -> dict[str, Any]:
    if params is None:
        return {}
    if isinstance(params, list):
        raise _batch_error()
    if not isinstance(params, dict):
        raise schema_error("`sampling_params` must be an object")
    unknown = unknown_sampling_keys(params)
    if unknown:
        raise schema_error(unknown_sampling_key_error(unknown[0]))
    return params


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_param(params: dict[str, Any], key: str, default: int, *, minimum: int) -> int:
    value = params.get(key)
    if value is None:
        return default
    if not _is_int(value) or value < minimum:
        raise schema_error(f"`{key}` must be an integer >= {minimum}")
    return int(value)


def _bool_field(params: dict[str, Any], key: str) -> bool:
    value = params.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise schema_error(f"`{key}` must be a boolean")
    return value


def _stop_token_ids(value: Any) -> frozenset[int]:
    if value is None:
        return frozenset()
    if not isinstance(value, list) or not all(_is_int(token) for token in value):
        raise schema_error("`stop_token_ids` must be a list of integers")
    return frozenset(value)


def _check_context(prompt_tokens: int, max_new_tokens: int, context_length: int) -> None:
    if prompt_tokens >= context_length:
        raise value_error(context_length_error(prompt_tokens, context_length))
    if prompt_tokens + max_new_tokens > context_length:
        raise value_error(context_overflow_error(prompt_tokens, max_new_tokens, context_length))


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


def meta_info(request: SimRequest, completion_tokens: int, final: bool) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": request.rid,
        "finish_reason": request.finish_reason if final else None,
        "prompt_tokens": request.prompt_tokens,
        "completion_tokens": completion_tokens,
        "cached_tokens": 0,
        "num_retractions": request.num_retractions,
        "reasoning_tokens": 0,
        "weight_version": WEIGHT_VERSION,
    }
    if final:
        meta["e2e_latency"] = request.e2e_latency
    return meta


class Renderer:
    """Builds the bodies of one request; keeps the text decoded so far, so streaming stays linear."""

    def __init__(self, request: SimRequest, config: SimConfig) -> None:
        self.request = request
        self.incremental = config.incremental_output
        self.omit_output_ids = config.omit_output_ids
        self.sent = 0  # output tokens already sent
        self.text = ""
        self.decoded = 0

    def body(self, upto: int, final: bool) -> dict[str, Any]:
        request = self.request
        trim_stop = final and (request.finish_reason or {}).get("type") == FINISH_STOP
        visible = upto - 1 if trim_stop else upto  # output_ids keep the stop token, text does not
        self.text += detokenize(request.plan.token_ids[self.decoded : visible])
        self.decoded = visible
        body: dict[str, Any] = {"text": self.text}
        if not self.omit_output_ids:
            start = self.sent if self.incremental else 0
            body["output_ids"] = request.plan.token_ids[start:upto]
        self.sent = upto
        body["meta_info"] = meta_info(request, upto, final)
        return body

    def pending_events(self, interval: int) -> bytes:
        """SSE events for every boundary reached since the last call, the final one included."""
        request = self.request
        produced = request.produced
        final = request.done and request.outcome is not Outcome.DROPPED
        marks = list(range(self.sent + interval, produced + 1, interval))
        if final and (not marks or marks[-1] != produced):
            marks.append(produced)
        events = [sse_event(self.body(upto, final and upto == produced)) for upto in marks]
        if final:
            events.append(SSE_DONE_EVENT)
        return b"".join(events)


def sse_event(body: dict[str, Any]) -> bytes:
    return SSE_DATA_PREFIX + orjson.dumps(body) + SSE_END


# --- handlers ----------------------------------------------------------------------------------------


async def read_json(request: web.Request) -> Any:
    try:
        return orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise schema_error(f"invalid JSON: {exc}") from exc


async def handle_generate(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    engine.note_received()
    try:
        parsed = parse_generate(await read_json(request), engine.config)
        interval = parsed.stream_interval if parsed.stream else None
        sim_request = engine.submit(parsed.rid, parsed.prompt_ids, parsed.sampling, interval)
    except BadRequest as exc:
        engine.note_rejected()
        return json_response(exc.body, status=400)
    except DuplicateRequestError as exc:
        engine.note_rejected()
        return json_response(value_error(str(exc)).body, status=400)
    except OverloadedError as exc:
        return json_response(overloaded_error_body(str(exc)), status=503)
    try:
        if parsed.stream:
            return await _stream(request, sim_request, engine.config, parsed.stream_interval)
        return await _answer_when_done(request, sim_request, engine.config)
    finally:
        # Runs on cancellation too: a client that hangs up aborts its request, as SGLang does.
        engine.cancel(sim_request)


async def _answer_when_done(
    request: web.Request, sim_request: SimRequest, config: SimConfig
) -> web.StreamResponse:
    while not sim_request.done:
        await sim_request.wait()
    if sim_request.outcome is Outcome.DROPPED:
        return _cut_connection(request, web.Response())
    return json_response(Renderer(sim_request, config).body(sim_request.produced, final=True))


async def _stream(
    request: web.Request, sim_request: SimRequest, config: SimConfig, interval: int
) -> web.StreamResponse:
    response = web.StreamResponse(headers=SSE_HEADERS)
    renderer = Renderer(sim_request, config)
    try:
        await response.prepare(request)
        while True:
            ended = sim_request.done  # read before rendering: the request may end while we write
            events = renderer.pending_events(interval)
            if events:
                await response.write(events)
            if ended:
                break
            await sim_request.wait()
    except ConnectionError:
        return response  # the client is gone; handle_generate aborts the request
    if sim_request.outcome is Outcome.DROPPED:
        return _cut_connection(request, response)
    return response


def _cut_connection(request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
    """Simulate a network failure: close the socket without completing the response."""
    if request.transport is not None:
        request.transport.close()
    return response  # aiohttp finds the connection closed and drops the response quietly


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
    return web.Response(status=503 if request.app[ENGINE_KEY].stopping else 200)


def _tokenizer_path(config: SimConfig) -> str:
    return config.tokenizer_path or config.model_path


async def handle_model_info(request: web.Request) -> web.Response:
    config = request.app[ENGINE_KEY].config
    return json_response(
        {
            "model_path": config.model_path,
            "tokenizer_path": _tokenizer_path(config),
            "is_generation": True,
            "served_model_name": config.model_path,
            "weight_version": WEIGHT_VERSION,
            "preferred_sampling_params": None,
        }
    )


async def handle_server_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    config = engine.config
    return json_response(
        {
            **dataclasses.asdict(config),
            "port": request.url.port or config.port,
            "tokenizer_path": _tokenizer_path(config),
            "served_model_name": config.model_path,
            "incremental_streaming_output": config.incremental_output,
            "tp_size": 1,
            "dp_size": 1,
            # A KV pool that never runs out: every running request can use the whole context.
            "max_total_num_tokens": config.max_running_requests * config.context_length,
            "max_req_input_len": config.context_length - 1,
            "version": SIM_VERSION,
            "internal_states": [{"last_gen_throughput": engine.last_gen_throughput}],
        }
    )


async def handle_get_load(request: web.Request) -> web.Response:
    return json_response([request.app[ENGINE_KEY].load()])


async def handle_models(request: web.Request) -> web.Response:
    config = request.app[ENGINE_KEY].config
    model = {
        "id": config.model_path,
        "object": "model",
        "owned_by": "sglang",
        "root": config.model_path,
        "max_model_len": config.context_length,
    }
    return json_response({"object": "list", "data": [model]})


async def handle_sim_stats(request: web.Request) -> web.Response:
    raw = request.query.get("prefix_len", str(DEFAULT_STATS_PREFIX_LEN))
    if not raw.isdigit():
        return json_response(schema_error("prefix_len must be a non-negative integer").body, status=400)
    return json_response(request.app[ENGINE_KEY].stats(int(raw)))


async def handle_sim_reset(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    engine.reset_stats()
    return json_response(engine.stats())


async def handle_sim_config_get(request: web.Request) -> web.Response:
    return json_response(dataclasses.asdict(request.app[ENGINE_KEY].config))


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
    return json_response(dataclasses.asdict(config))


async def _start_engine(app: web.Application) -> None:
    await app[ENGINE_KEY].start()


async def _stop_engine(app: web.Application) -> None:
    await app[ENGINE_KEY].stop()


def build_app(config: SimConfig | None = None) -> web.Application:
    app = web.Application()
    app[ENGINE_KEY] = SimEngine(config or SimConfig())
    app.on_startup.append(_start_engine)
    app.on_shutdown.append(_stop_engine)
    app.add_routes(
        [
            web.post(GENERATE_PATH, handle_generate),
            web.post(ABORT_PATH, handle_abort),
            web.get(HEALTH_PATH, handle_health),
            web.get(HEALTH_GENERATE_PATH, handle_health),
            web.get(MODEL_INFO_PATH, handle_model_info),
            web.get("/get_model_info", handle_model_info),
            web.get(SERVER_INFO_PATH, handle_server_info),
            web.get("/get_server_info", handle_server_info),
            web.get(GET_LOAD_PATH, handle_get_load),
            web.get(MODELS_PATH, handle_models),
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


async def serve(config: SimConfig, *, on_ready: Callable[[int], None], stop: asyncio.Event) -> None:
    """Serve until ``stop`` is set; ``on_ready`` gets the bound port (useful with port 0)."""
    runner = web.AppRunner(
        build_app(config),
        handler_cancellation=True,  # so a client that hangs up cancels its handler at once
        access_log=None,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        on_ready(runner.addresses[0][1])
        await stop.wait()
    finally:
        await runner.cleanup()


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
        await serve(self.config, on_ready=self._on_ready, stop=self._stop_event)

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


def _optional_str(text: str) -> str | None:
    return None if text.lower() in ("", "none") else text


_ARG_TYPES: Final[dict[Any, Callable[[str], Any]]] = {
    int: int,
    float: float,
    str: str,
    int | None: _optional_int,
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


async def _serve_until_signalled(config: SimConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)

    def announce(port: int) -> None:
        print(f"tokenfleet sim listening on {http_url(config.host, port)}", flush=True)

    await serve(config, on_ready=announce, stop=stop)


def main(argv: Sequence[str] | None = None) -> int:
    """``tokenfleet sim``: serve until SIGINT or SIGTERM."""
    asyncio.run(_serve_until_signalled(parse_config(argv)))
    return 0
