"""``POST /generate`` on the wire: keep-alive HTTP/1.1 connections, shared by a process's threads.

The data plane uses the standard library's ``http.client`` rather than httpx: a short generation is a
small POST and a small answer, and per request httpx spent 1.06 ms of CPU against 0.45 through this module
(``python bench/http_clients.py``); with 64 generations in flight on a 2-core machine that difference was
what kept the fleet below 0.9x of the anchor on short outputs (docs/performance.md). The control plane
(``/abort_request``, ``/server_info``, health probes) stays on httpx.

What a connection pool does for us otherwise, done here:

- A connection carries one request at a time. Idle ones wait per server, the most recently used on top:
  a generation takes the freshest, whichever thread runs it. (One connection per thread reused almost
  none: a pool of 1,152 threads hands each sample to the thread idle longest, whose connection was past
  ``IDLE_REUSE_S``; at 1,024 in flight the simulator accepted a new connection for nearly every request,
  about a tenth of its CPU, and a server answering 500 requests a second would hold 30,000 closed
  connections in TIME_WAIT, about all of a host's ephemeral ports.)
- A connection is reused only when its last answer was read to the end and the server did not say
  ``Connection: close``; a stream we stopped early is closed, which is also how the server learns to abort.
- Before reuse, a connection the server has closed (or sent anything on) since is dropped: the socket is
  readable when it should be silent. Idle connections are not kept past ``IDLE_REUSE_S``.
- Credentials in the server URL (``http://user:pass@host``) become a Basic ``Authorization`` header, and a
  path in it (``http://host/sglang``) prefixes the route, as httpx does.
- Proxy variables (``HTTP_PROXY``) are not honoured: the fleet talks to its servers directly.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import http.client
import select
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final
from urllib.parse import unquote, urlsplit

#: A connection idle this long is not reused (servers close idle keep-alive connections: uvicorn after 5 s).
IDLE_REUSE_S: Final = 2.0
#: After the part of an answer that matters (a stream's final chunk), how long to wait for the rest.
FINISH_READ_S: Final = 1.0
#: Bytes asked of the socket per read of a streamed answer.
READ_SIZE: Final = 65536

#: What the wire raises for the connection's failures (a timeout is an ``OSError``).
WireError = (OSError, http.client.HTTPException)


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where a server URL points: scheme, host, port, path prefix and the headers its URL implies."""

    https: bool
    host: str
    port: int
    prefix: str
    headers: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, url: str) -> Endpoint:
        parts = urlsplit(url)
        https = parts.scheme.lower() == "https"
        headers: list[tuple[str, str]] = [("Content-Type", "application/json")]
        if parts.username is not None:
            user_pass = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            headers.append(("Authorization", "Basic " + base64.b64encode(user_pass.encode()).decode()))
        return cls(
            https=https,
            host=parts.hostname or "",
            port=parts.port or (443 if https else 80),
            prefix=parts.path.rstrip("/"),
            headers=tuple(headers),
        )


@dataclass(slots=True)
class Exchange:
    """One request's response, and whether its caller read all it wanted of it."""

    response: http.client.HTTPResponse
    connection: http.client.HTTPConnection
    complete: bool = False

    def set_read_timeout(self, seconds: float) -> None:
        """From now on a read that waits longer than ``seconds`` raises ``TimeoutError``."""
        _set_timeout(self.connection, seconds)

    def hang_up(self) -> None:
        """End the exchange from another thread: the socket is shut down, so the reader's next read ends
        at once (the server sees the connection closed and aborts the request). Only shut down, not
        closed: closing under a reading thread makes its read fail in odd ways; the reader's own thread
        discards the connection."""
        sock = self.connection.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


@dataclass(slots=True)
class _Idle:
    connection: http.client.HTTPConnection
    since: float


class Wire:
    """Thread-safe: a request takes an idle connection to its server (or opens one) and gives it back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._endpoints: dict[str, Endpoint] = {}
        # Per server, the idle connections, the most recently given back last. A deque's append, pop and
        # popleft are atomic: threads share it without a lock.
        self._idle: dict[str, collections.deque[_Idle]] = {}
        # Weak: a connection discarded (or dropped with an idle deque) leaves on its own.
        self._open: weakref.WeakSet[http.client.HTTPConnection] = weakref.WeakSet()
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    @contextmanager
    def post(
        self,
        server: str,
        path: str,
        body: bytes,
        *,
        timeout_s: float,
        connect_timeout_s: float,
        headers: Mapping[str, str] | None = None,
    ) -> Iterator[Exchange]:
        """POST ``body`` (JSON) to ``server + path``; yields the exchange, its response's headers read.

        Set ``Exchange.complete`` once the answer was read to its end, or all that matters of it was (the
        rest is then read within ``FINISH_READ_S``): only then is the connection used again.
        Raises ``WireError`` (``OSError`` or ``http.client.HTTPException``) for the connection's failures.
        """
        endpoint = self._endpoint(server)
        connection = self._take(server, endpoint, connect_timeout_s)
        reusable = False
        try:
            _set_timeout(connection, timeout_s)
            sent = dict(endpoint.headers) | dict(headers or {})
            connection.request("POST", endpoint.prefix + path, body=body, headers=sent)
            exchange = Exchange(connection.getresponse(), connection)
            yield exchange
            reusable = exchange.complete and _read_to_end(connection, exchange.response)
        finally:
            if reusable:
                self._give_back(server, connection)
            else:
                self._discard(connection)

    def close(self) -> None:
        """Close every connection (of every thread; a stream being read ends with an error at once);
        later calls raise ``RuntimeError``."""
        with self._lock:
            self._closed = True
            connections, self._open = list(self._open), weakref.WeakSet()
            self._idle.clear()
        for connection in connections:
            _hang_up(connection)

    # --- connections ----------------------------------------------------------------------------

    def _endpoint(self, server: str) -> Endpoint:
        endpoint = self._endpoints.get(server)
        if endpoint is None:
            endpoint = self._endpoints[server] = Endpoint.of(server)
        return endpoint

    def _idle_of(self, server: str) -> collections.deque[_Idle]:
        idle = self._idle.get(server)
        if idle is None:
            with self._lock:
                idle = self._idle.setdefault(server, collections.deque())
        return idle

    def _take(self, server: str, endpoint: Endpoint, connect_timeout_s: float) -> http.client.HTTPConnection:
        idle = self._idle_of(server)
        while True:
            try:
                kept = idle.pop()
            except IndexError:
                break
            # The freshest first: once one is too old, the rest below it are older still.
            if time.monotonic() - kept.since <= IDLE_REUSE_S and _still_open(kept.connection):
                return kept.connection
            self._discard(kept.connection)
        connection: http.client.HTTPConnection
        if endpoint.https:
            connection = http.client.HTTPSConnection(
                endpoint.host, endpoint.port, timeout=connect_timeout_s, context=self._ssl_context()
            )
        else:
            connection = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=connect_timeout_s)
        try:
            connection.connect()  # under the connect timeout; the request sets its own read timeout
        except BaseException:
            connection.close()
            raise
        with self._lock:  # registered only now: close() may have run while we connected
            if not self._closed:
                self._open.add(connection)
                return connection
        connection.close()
        raise RuntimeError("the SGLang client is closed")

    def _give_back(self, server: str, connection: http.client.HTTPConnection) -> None:
        idle = self._idle_of(server)
        now = time.monotonic()
        idle.append(_Idle(connection, now))
        # The oldest idle one, if too old to be used, is closed now: idle connections never pile up past
        # what the busiest moment needed for longer than the reuse limit.
        try:
            oldest = idle.popleft()
        except IndexError:
            return
        if now - oldest.since <= IDLE_REUSE_S:
            idle.appendleft(oldest)
        else:
            self._discard(oldest.connection)

    def _discard(self, connection: http.client.HTTPConnection) -> None:
        with self._lock:
            self._open.discard(connection)
        connection.close()

    def _ssl_context(self) -> ssl.SSLContext:
        with self._lock:
            if self._ssl is None:
                self._ssl = tls_context()
            return self._ssl


def tls_context() -> ssl.SSLContext:
    """How https servers are verified, by the wire and by the control plane's httpx clients alike: the
    system's certificate authorities (``SSL_CERT_FILE`` and ``SSL_CERT_DIR`` honoured)."""
    return ssl.create_default_context()


def _set_timeout(connection: http.client.HTTPConnection, seconds: float) -> None:
    if connection.sock is not None:
        connection.sock.settimeout(seconds)


def _hang_up(connection: http.client.HTTPConnection) -> None:
    """Close ``connection`` even while another thread reads from it: shut the socket down first (closing
    alone waits for the reader, whose response still holds the socket)."""
    sock = connection.sock
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
    connection.close()


def _read_to_end(connection: http.client.HTTPConnection, response: http.client.HTTPResponse) -> bool:
    """Whether the connection can carry another request: the answer is read to its end (reading what is
    left of it, such as a stream's ``data: [DONE]``, for at most ``FINISH_READ_S``) and the server keeps
    the connection open."""
    if response.will_close:
        return False
    if not response.isclosed():
        try:
            _set_timeout(connection, FINISH_READ_S)
            response.read()
        except WireError:
            return False
    return response.isclosed() and connection.sock is not None


def _still_open(connection: http.client.HTTPConnection) -> bool:
    """A kept connection's socket must have nothing to read: readable means closed by the server (or
    garbage we would misread as the next answer)."""
    sock = connection.sock
    if sock is None:
        return False
    try:
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return not poller.poll(0)
    except (OSError, ValueError):
        return False


def iter_lines(response: http.client.HTTPResponse) -> Iterator[bytes]:
    """The lines of a streamed (chunked or sized) answer, as they arrive, without their line ends."""
    pending = b""
    while True:
        data = response.read1(READ_SIZE)
        if not data:
            break
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r")
    if pending:
        yield pending.rstrip(b"\r")
