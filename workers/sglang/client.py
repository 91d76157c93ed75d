"""A synchronous client for SGLang's native ``/generate``, streaming, with abort.

``/generate`` goes over ``wire.py`` (http.client, a connection per thread and server: the hot path); the
small endpoints over httpx.

Errors are classified by HTTP status, never by message text (``shared/reference/sglang-http.md``):
4xx is the input's fault (``RequestRejected``, not retried), 5xx and transport errors are retryable
(``ServerUnavailable``), 401/403 mean this process holds no valid key (``Unauthorized``), and an answer
without ``output_ids`` is a configuration error (``ProtocolError``, sglang < 0.5.2). A 200 stream can still
carry an error: an ``{"error": {..., "code": 400}}`` chunk (context length, duplicate rid) or a final
abort whose ``finish_reason.status_code`` is 400 (prompt over ``max_req_input_len``, bad ``stop_regex``)
or 503 (queue full, timeouts): both are classified by that code like an HTTP status. An abort with no
status code is a plain abort (ours, or the server's own): callers read ``Generation.finish_reason``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import httpx
import orjson

from budget import defaults
from budget.urls import redact_url
from workers.sglang import protocol
from workers.sglang.auth import NO_AUTH, ServerAuth
from workers.sglang.wire import Exchange, Wire, WireError, iter_lines, tls_context

#: After asking the server to abort, how long to keep reading for its final chunk (the exact partial
#: output) before closing the stream ourselves.
ABORT_GRACE_S: Final = 2.0

#: Connect timeout: a server that does not accept a connection in this time is treated as down.
CONNECT_TIMEOUT_S: Final = 10.0

#: Our ``finish_reason`` when we cut a stream and the server sent no final chunk in the grace time.
LOCAL_ABORT_MESSAGE: Final = "Aborted by tokenfleet"

#: Called with the number of new tokens in each streamed chunk; returns False to stop the generation.
OnTokens = Callable[[int], bool]


class SGLangError(Exception):
    """Root of the client's errors."""

    def __init__(self, message: str, *, server: str = "", status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.server = server
        self.status = status


class RequestRejected(SGLangError):
    """4xx: the request itself is wrong (unknown sampling key, prompt too long). Never retried."""


class ServerUnavailable(SGLangError):
    """5xx, a transport error, a dropped stream or a timeout: retry, with a new rid."""


class ServerStalled(ServerUnavailable):
    """The server sent nothing for the stall timeout (frozen, a black hole behind a live port, a wedged
    engine): the request was given up, and the server is suspect until a real generation succeeds."""


class ServerBusy(ServerUnavailable):
    """The server shed the request (a full queue, a waiting or running timeout: an abort with status
    503): retried elsewhere, but it says the server is busy, not broken, so it does not count against
    the server's health."""


class ProtocolError(SGLangError):
    """The server's answer lacks what we need (``output_ids``): a configuration error, not retried."""


class Unauthorized(SGLangError):
    """401/403: the server wants an API key this process does not hold (or holds a wrong one). Neither
    the sample's fault nor the server's: the sample goes back for a worker that has the key."""


class _NotSent(Exception):
    """Internal: the request was stopped before it was sent."""


class StopHandle:
    """One streaming request that another thread may stop (``workers.stops``): it asks the server to
    abort the rid, and hangs up the stream when the server cannot or does not end it in time."""

    __slots__ = ("_exchange", "_lock", "abort_sent_at", "reason", "rid", "server")

    def __init__(self, rid: str = "", server: str = "") -> None:
        self._lock = threading.Lock()
        self._exchange: Exchange | None = None
        #: Why it was asked to stop; "" while it runs.
        self.reason = ""
        #: When an abort of the current rid was last sent (monotonic), 0 before: the grace before
        #: hanging up runs from there.
        self.abort_sent_at = 0.0
        #: The request it stops now (a conversation sends one request per reply, each with its rid).
        self.rid = rid
        self.server = server

    @property
    def requested(self) -> bool:
        return bool(self.reason)

    def request(self, reason: str) -> bool:
        """Mark it stopped; False if it already was."""
        with self._lock:
            if self.reason:
                return False
            self.reason = reason
            return True

    def hang_up(self) -> None:
        """Close its stream now (the server aborts a request whose client went away)."""
        with self._lock:
            exchange = self._exchange
        if exchange is not None:
            exchange.hang_up()

    def attach(self, exchange: Exchange | None) -> None:
        with self._lock:
            self._exchange = exchange


@dataclass(slots=True)
class Generation:
    """One finished (or stopped) ``/generate`` call."""

    rid: str
    server: str
    output_ids: list[int]
    text: str
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    meta_info: dict[str, Any] = field(default_factory=dict)
    #: We asked for the stop (``on_tokens`` returned False).
    stopped_by_us: bool = False

    @property
    def aborted(self) -> bool:
        return protocol.is_abort(self.finish_reason)  # type: ignore[arg-type]

    @property
    def reasoning_tokens(self) -> int:
        """Of ``completion_tokens``, those the model spent thinking, as the server reports them
        (``meta_info.reasoning_tokens``; 0 when it reports none or no number), never more than the
        completion."""
        return reported_reasoning_tokens(self.meta_info, self.completion_tokens)


def reported_reasoning_tokens(meta_info: Mapping[str, Any], completion_tokens: int) -> int:
    """``meta_info.reasoning_tokens`` as a count within ``[0, completion_tokens]`` (0 when absent or not a
    number)."""
    value = meta_info.get("reasoning_tokens")
    if not isinstance(value, int | float) or isinstance(value, bool):
        return 0
    return min(max(0, int(value)), max(0, completion_tokens))


@dataclass(slots=True)
class StreamAccumulator:
    """Folds streamed chunks into the full output, for cumulative and incremental ``output_ids``.

    SGLang streams cumulative ``output_ids`` by default and deltas with ``--incremental-streaming-output``;
    ``meta_info.completion_tokens`` is cumulative in both, so a chunk whose ids are as long as
    ``completion_tokens`` is cumulative, and otherwise a delta.
    """

    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    meta_info: dict[str, Any] = field(default_factory=dict)
    finished: bool = False

    def feed(self, chunk: dict[str, Any]) -> int:
        """Take one chunk; returns how many new tokens it brought."""
        meta = chunk.get("meta_info") or {}
        completion = int(meta.get("completion_tokens") or 0)
        ids = chunk.get("output_ids")
        if ids is None:
            if completion:
                raise ProtocolError(
                    "the server's answer has no output_ids (sglang older than 0.5.2?): "
                    "tokenfleet needs the exact token ids"
                )
            ids = []
        before = len(self.output_ids)
        text = chunk.get("text") or ""
        if len(ids) == completion:  # cumulative (a delta is this long only when it is the first one)
            self.output_ids = list(ids)
        else:
            self.output_ids.extend(ids)
        # ``text`` may be cumulative even when the ids are deltas: keep whichever extends what we have.
        self.text = text if text.startswith(self.text) else self.text + text
        self.meta_info = meta
        if meta.get("finish_reason") is not None:
            self.finished = True
        return len(self.output_ids) - before


def _error_status(error: Any) -> int:
    """The HTTP status an in-stream error chunk carries (500 when it names none we can read)."""
    status = error.get("code") or error.get("status_code") if isinstance(error, dict) else None
    try:
        return int(status or 500)
    except (TypeError, ValueError):
        return 500


def _describe(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _error_message(body: bytes) -> str:
    """The message of SGLang's error shapes: {"error": str}, {"error": {"message"}}, {"message"}."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode("utf-8", "replace").strip()[:500] or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)
    return str(data)


def _error_class(status: int) -> type[SGLangError]:
    if status in (401, 403):
        return Unauthorized
    if 400 <= status < 500 and status not in (408, 429):
        return RequestRejected
    return ServerUnavailable


def _raise_for_status(server: str, status: int, body: bytes) -> None:
    if status < 400:
        return
    message = _error_message(body)
    raise _error_class(status)(f"HTTP {status}: {message}", server=server, status=status)


def _raise_for_abort_status(server: str, finish: Any) -> None:
    """A final abort that carries an HTTP status (a scheduler-side rejection or shed load) is that
    error, not a plain abort."""
    if not protocol.is_abort(finish):
        return
    status = finish.get("status_code")
    if not isinstance(status, int) or isinstance(status, bool) or status < 400:
        return
    message = str(finish.get("message") or finish.get("err_type") or "aborted")
    cls = ServerBusy if status == 503 else _error_class(status)
    raise cls(
        f"{redact_url(server)}: aborted by the server with status {status}: {message}",
        server=server,
        status=status,
    )


def _iter_events(lines: Iterator[bytes]) -> Iterator[dict[str, Any]]:
    """The JSON objects of an SSE stream, up to ``data: [DONE]``."""
    for line in lines:
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == protocol.SSE_DONE:
            return
        yield orjson.loads(data)


class SGLangClient:
    """Thread-safe: one per worker process, shared by its threads."""

    def __init__(self, *, max_connections: int = 256) -> None:
        self._http = httpx.Client(
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            headers={"Content-Type": "application/json"},
            verify=tls_context(),  # the wire's certificate authorities, not certifi's
        )
        self._wire = Wire()
        self._auth: dict[str, ServerAuth] = {}

    def set_auth(self, server: str, auth: ServerAuth) -> None:
        """The keys to send to ``server`` from now on."""
        self._auth[server] = auth

    def auth(self, server: str) -> ServerAuth:
        return self._auth.get(server, NO_AUTH)

    def close(self) -> None:
        self._wire.close()
        self._http.close()

    def __enter__(self) -> SGLangClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- small endpoints ------------------------------------------------------------------------

    def get_json(self, server: str, path: str, timeout_s: float = 10.0) -> dict[str, Any]:
        try:
            r = self._http.get(server + path, timeout=timeout_s, headers=self.auth(server).headers())
        except httpx.HTTPError as e:
            raise ServerUnavailable(f"{redact_url(server)}: {type(e).__name__}: {e}", server=server) from None
        _raise_for_status(server, r.status_code, r.content)
        data: dict[str, Any] = orjson.loads(r.content)
        return data

    def server_info(self, server: str) -> dict[str, Any]:
        """``/server_info``, or the deprecated ``/get_server_info`` that sglang-router 0.3 answers instead."""
        try:
            return self.get_json(server, protocol.SERVER_INFO_PATH)
        except RequestRejected as e:
            if e.status != 404:
                raise
            return self.get_json(server, protocol.GET_SERVER_INFO_PATH)

    def abort(self, server: str, rid: str, timeout_s: float = 5.0) -> bool:
        """Ask ``server`` to abort the live request ``rid`` (only an exact, live rid aborts anything on a
        real server). Returns whether the server took the request: sglang-router does not proxy
        ``/abort_request`` (404), and a wrong admin key is a 401."""
        # A failed abort is not an error: closing our stream aborts the request as well.
        with contextlib.suppress(httpx.HTTPError):
            r = self._http.post(
                server + protocol.ABORT_PATH,
                content=orjson.dumps({"rid": rid}),
                timeout=timeout_s,
                headers=self.auth(server).admin_headers(),
            )
            return r.status_code == 200
        return False

    def tokenize(self, server: str, text: str, timeout_s: float = 10.0) -> list[int] | None:
        """The ids ``server``'s tokenizer makes of ``text`` (``/tokenize``), or None where it has no such
        endpoint or fails: a text prompt is then not continued past a grant."""
        try:
            r = self._http.post(
                server + protocol.TOKENIZE_PATH,
                content=orjson.dumps({"prompt": text}),
                timeout=timeout_s,
                headers=self.auth(server).headers(),
            )
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        try:
            tokens = orjson.loads(r.content).get("tokens")
        except (orjson.JSONDecodeError, AttributeError):
            return None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return None
        return tokens

    # --- generate -------------------------------------------------------------------------------

    def generate(
        self,
        server: str,
        *,
        rid: str,
        sampling_params: dict[str, Any],
        input_ids: list[int] | None = None,
        text: str | None = None,
        timeout_s: float = defaults.TIMEOUT_S,
        on_tokens: OnTokens | None = None,
        stop: StopHandle | None = None,
        stall_timeout_s: float | None = None,
    ) -> Generation:
        """Stream one generation from ``server``. ``on_tokens`` sees each chunk's new tokens (but the
        last's) and may stop it; so may another thread through ``stop``. A server that sends nothing for
        ``stall_timeout_s`` (its answer's headers, or the next chunk) raises ``ServerStalled``.

        Raises ``RequestRejected``, ``ServerUnavailable``, ``Unauthorized`` or ``ProtocolError``.
        """
        payload: dict[str, Any] = {"rid": rid, "sampling_params": sampling_params, "stream": True}
        if input_ids is not None:
            payload["input_ids"] = input_ids
        else:
            payload["text"] = text
        deadline = time.monotonic() + timeout_s
        acc = StreamAccumulator()
        if stop is not None:
            stop.rid, stop.server = rid, server
        stopped = stop is not None and stop.requested  # stopped before it started: nothing is sent
        try:
            if stopped:
                raise _NotSent
            with self._wire.post(
                server,
                protocol.GENERATE_PATH,
                orjson.dumps(payload),
                # Each read waits at most this long: a stream silent for longer is stalled.
                timeout_s=min(timeout_s, stall_timeout_s or timeout_s),
                connect_timeout_s=min(CONNECT_TIMEOUT_S, timeout_s),
                headers=self.auth(server).headers(),
            ) as exchange:
                response = exchange.response
                if response.status != 200:
                    _raise_for_status(server, response.status, response.read())
                if stop is not None:
                    stop.attach(exchange)
                try:
                    stopped = self._read_stream(server, rid, exchange, acc, deadline, on_tokens, stop)
                finally:
                    if stop is not None:
                        stop.attach(None)
                # A stream we stopped is closed with its connection: that aborts it on the server.
                exchange.complete = not stopped
        except _NotSent:
            pass
        except TimeoutError as e:
            if stop is not None and stop.requested:
                stopped = True
            elif stall_timeout_s is not None and stall_timeout_s < timeout_s:
                raise ServerStalled(
                    f"{redact_url(server)}: stalled: nothing received for {stall_timeout_s:g} s",
                    server=server,
                ) from None
            else:
                raise ServerUnavailable(f"{redact_url(server)}: {_describe(e)}", server=server) from None
        except orjson.JSONDecodeError as e:
            raise ServerUnavailable(
                f"{redact_url(server)}: malformed stream chunk: {e}", server=server
            ) from None
        except WireError as e:
            if stop is not None and stop.requested:
                stopped = True  # we hung up on it (``StopHandle.hang_up``): what we have is the output
            else:
                raise ServerUnavailable(f"{redact_url(server)}: {_describe(e)}", server=server) from None
        if not acc.finished and not stopped:
            raise ServerUnavailable(
                f"{redact_url(server)}: the stream ended before the generation finished", server=server
            )
        meta = acc.meta_info
        finish = meta.get("finish_reason")
        if not stopped:
            _raise_for_abort_status(server, finish)
        if stopped and not protocol.is_abort(finish):
            finish = {"type": protocol.FINISH_ABORT, "message": LOCAL_ABORT_MESSAGE}
        return Generation(
            rid=rid,
            server=server,
            output_ids=acc.output_ids,
            text=acc.text,
            finish_reason=finish,
            prompt_tokens=int(meta.get("prompt_tokens") or len(input_ids or [])),
            completion_tokens=len(acc.output_ids),
            meta_info=meta,
            stopped_by_us=stopped,
        )

    def _read_stream(
        self,
        server: str,
        rid: str,
        exchange: Exchange,
        acc: StreamAccumulator,
        deadline: float,
        on_tokens: OnTokens | None,
        stop: StopHandle | None = None,
    ) -> bool:
        """Reads chunks into ``acc``; returns True when we stopped the generation (the caller then closes
        the connection, which aborts the request on the server if it is still running)."""
        stop_deadline: float | None = None
        try:
            for chunk in _iter_events(iter_lines(exchange.response)):
                if not isinstance(chunk, dict):
                    raise ServerUnavailable(
                        f"{redact_url(server)}: a stream chunk that is not a JSON object", server=server
                    )
                if "error" in chunk and "meta_info" not in chunk:
                    _raise_for_status(server, _error_status(chunk["error"]), orjson.dumps(chunk))
                new = acc.feed(chunk)
                if acc.finished:
                    return stop_deadline is not None or (stop is not None and stop.requested)
                now = time.monotonic()
                if stop_deadline is not None:
                    if now > stop_deadline:
                        return True  # the server sent no final chunk in time: closing the stream aborts it
                    continue
                if stop is not None and stop.requested:
                    # Another thread asked the server to abort the rid, and the stream goes on: that abort
                    # may have crossed this request on its way in (a server drops an abort for a rid it
                    # does not know yet). The stream has spoken, so the rid is live now: abort it again
                    # (a second abort of a rid is harmless); its final chunk comes after one more step.
                    stop.abort_sent_at = now
                    if not self.abort(server, rid):
                        return True  # no abort endpoint (a router): closing the stream aborts it
                    stop_deadline = now + ABORT_GRACE_S
                    exchange.set_read_timeout(ABORT_GRACE_S)
                    continue
                if now > deadline:
                    self.abort(server, rid)
                    raise ServerUnavailable(
                        f"{redact_url(server)}: no answer within the request timeout", server=server
                    )
                if on_tokens is not None and new and not on_tokens(new):
                    if not self.abort(server, rid):
                        return True  # no abort endpoint (a router): closing the stream is what aborts it
                    stop_deadline = now + ABORT_GRACE_S
                    # A read must not outwait the grace (the server took the abort but may never end
                    # the stream, e.g. it does not know the rid): the socket's timeout says so.
                    exchange.set_read_timeout(ABORT_GRACE_S)
        except TimeoutError:
            if stop_deadline is None and not (stop is not None and stop.requested):
                raise
            return True
        return stop_deadline is not None or (stop is not None and stop.requested)
