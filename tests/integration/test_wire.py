"""The data plane's HTTP connections (workers/sglang/wire.py) against a real HTTP/1.1 server that records
what it is sent and on which connection (the client's port names the connection)."""

from __future__ import annotations

import base64
import http.server
import shutil
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.support.fleet import self_signed_certificate, wait_until
from tokenfleet.processes import free_port
from workers.sglang import client as client_module
from workers.sglang import wire as wire_module
from workers.sglang.client import ServerUnavailable, SGLangClient
from workers.sglang.wire import Wire, WireError

pytestmark = pytest.mark.integration


@dataclass
class Seen:
    port: int
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class Recorder:
    """What the server saw, and how it should answer."""

    seen: list[Seen] = field(default_factory=list)
    close_after_answer: bool = False  # drop the connection after answering, without saying so
    delay_s: float = 0.0
    stall_s: float = 0.0  # a stream stops this long after its first chunk (an abort does not end it)
    chunks: list[bytes] | None = None  # raw SSE events to stream instead of the planned answer
    aborts: list[str] = field(default_factory=list)
    closed: int = 0  # connections the server has closed


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    recorder: Recorder

    def do_POST(self) -> None:
        body = orjson.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path.endswith("/abort_request"):
            self.recorder.aborts.append(body["rid"])
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.recorder.seen.append(
            Seen(self.client_address[1], self.path, {k.lower(): v for k, v in self.headers.items()}, body)
        )
        time.sleep(self.recorder.delay_s)
        ids = list(range(int(body["sampling_params"].get("max_new_tokens", 128))))
        final = {
            "text": "x",
            "output_ids": ids,
            "meta_info": {
                "completion_tokens": len(ids),
                "prompt_tokens": 2,
                "finish_reason": {"type": "length", "length": len(ids)},
            },
        }
        if body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            half = {
                **final,
                "output_ids": ids[: len(ids) // 2],
                "meta_info": {"completion_tokens": len(ids) // 2, "finish_reason": None},
            }
            events = self.recorder.chunks or [b"data: " + orjson.dumps(e) + b"\n\n" for e in (half, final)]
            for n, event in enumerate(events):
                self._chunk(event)
                self.wfile.flush()
                if n == 0 and self.recorder.stall_s:
                    time.sleep(self.recorder.stall_s)
                    return
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")
        else:
            data = orjson.dumps(final)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        self.wfile.flush()
        if self.recorder.close_after_answer:
            self.close_connection = True

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    def log_message(self, *args: Any) -> None:
        pass


class _QuietServer(http.server.ThreadingHTTPServer):
    recorder: Recorder

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hung up mid-stream is what some tests do

    def shutdown_request(self, request: Any) -> None:
        super().shutdown_request(request)
        self.recorder.closed += 1


@contextmanager
def serving(tls: ssl.SSLContext | None = None) -> Iterator[tuple[str, Recorder]]:
    recorder = Recorder()
    handler = type("Handler", (_Handler,), {"recorder": recorder})
    httpd = _QuietServer(("127.0.0.1", free_port()), handler)
    httpd.recorder = recorder
    if tls is not None:
        httpd.socket = tls.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{httpd.server_address[1]}", recorder
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def server() -> Iterator[tuple[str, Recorder]]:
    with serving() as served:
        yield served


@pytest.fixture
def certificate(tmp_path: Path) -> Path:
    """A self-signed certificate for 127.0.0.1 (its key beside it, ``key.pem``)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl on this machine")
    return self_signed_certificate(tmp_path)


def post(w: Wire, url: str, body: dict[str, Any], *, complete: bool = True) -> bytes:
    with w.post(url, "/generate", orjson.dumps(body), timeout_s=5, connect_timeout_s=5) as exchange:
        data = exchange.response.read() if complete else exchange.response.read(10)
        exchange.complete = complete
        return data


BODY = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4}}


def test_one_thread_sends_its_requests_over_one_kept_connection(server: tuple[str, Recorder]) -> None:
    url, recorder = server
    w = Wire()
    answers = [orjson.loads(post(w, url, BODY)) for _ in range(3)]
    assert [a["output_ids"] for a in answers] == [[0, 1, 2, 3]] * 3
    assert len({s.port for s in recorder.seen}) == 1
    w.close()


def test_a_connection_given_back_by_one_thread_carries_the_next_threads_request(
    server: tuple[str, Recorder],
) -> None:
    # A pool's threads take turns: the thread that runs the next generation is rarely the one that ran
    # the last, and its request must still go over the connection the last one freed.
    url, recorder = server
    w = Wire()
    for _ in range(4):
        t = threading.Thread(target=post, args=(w, url, BODY))
        t.start()
        t.join()
    assert len(recorder.seen) == 4 and len({s.port for s in recorder.seen}) == 1
    w.close()


def test_requests_at_once_each_have_a_connection_of_their_own(server: tuple[str, Recorder]) -> None:
    url, recorder = server
    w = Wire()
    # Two answers held open at once (the first not read yet), then a third request: it takes the
    # connection given back most recently.
    with w.post(url, "/generate", orjson.dumps(BODY), timeout_s=5, connect_timeout_s=5) as first:
        post(w, url, BODY)
        first.response.read()
        first.complete = True
    post(w, url, BODY)
    ports = [s.port for s in recorder.seen]
    assert len(ports) == 3 and ports[0] != ports[1] and ports[2] == ports[0]
    w.close()


def test_idle_connections_past_the_reuse_limit_are_closed_as_others_are_given_back(
    server: tuple[str, Recorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _ = server
    w = Wire()
    with w.post(url, "/generate", orjson.dumps(BODY), timeout_s=5, connect_timeout_s=5) as first:
        post(w, url, BODY)  # a second connection, idle from now on
        first.response.read()
        first.complete = True
    assert len(w._open) == 2
    monkeypatch.setattr(wire_module, "IDLE_REUSE_S", 0.0)
    time.sleep(0.01)
    with w.post(url, "/generate", orjson.dumps(BODY), timeout_s=5, connect_timeout_s=5) as exchange:
        exchange.response.read()
        exchange.complete = True
    # Both idle ones were too old: the request's own was taken after closing them, or given back after.
    assert len(w._open) == 1
    w.close()


def test_a_connection_the_server_closed_while_idle_is_replaced_not_failed(
    server: tuple[str, Recorder],
) -> None:
    url, recorder = server
    recorder.close_after_answer = True  # closes without "Connection: close": only the socket tells
    w = Wire()
    for n in range(1, 4):
        post(w, url, BODY)
        # the server has closed it (its close then reaches us at once)
        wait_until(lambda n=n: recorder.closed >= n, 10, "the server to close the connection")
    assert len({s.port for s in recorder.seen}) == 3
    w.close()


def test_a_connection_idle_longer_than_the_reuse_limit_is_replaced(
    server: tuple[str, Recorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, recorder = server
    monkeypatch.setattr(wire_module, "IDLE_REUSE_S", 0.0)
    w = Wire()
    post(w, url, BODY)
    time.sleep(0.01)
    post(w, url, BODY)
    assert len({s.port for s in recorder.seen}) == 2
    w.close()


def test_an_answer_left_unread_closes_its_connection(server: tuple[str, Recorder]) -> None:
    url, recorder = server
    w = Wire()
    post(w, url, BODY, complete=False)
    post(w, url, BODY)
    post(w, url, BODY)
    ports = [s.port for s in recorder.seen]
    assert ports[0] != ports[1] and ports[1] == ports[2]
    w.close()


def test_credentials_and_a_path_in_the_server_url_are_honoured(server: tuple[str, Recorder]) -> None:
    url, recorder = server
    w = Wire()
    post(w, url.replace("http://", "http://fleet:s%40cret@") + "/sglang/", BODY)
    seen = recorder.seen[0]
    assert seen.path == "/sglang/generate"
    assert seen.headers["authorization"] == "Basic " + base64.b64encode(b"fleet:s@cret").decode()
    assert seen.headers["content-type"] == "application/json"
    w.close()


def test_https_servers_are_verified_against_the_trusted_certificates(
    certificate: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(certificate, certificate.parent / "key.pem")
    with serving(tls) as (url, recorder):
        untrusting = Wire()
        with pytest.raises(WireError, match="CERTIFICATE_VERIFY_FAILED"):
            post(untrusting, url, BODY)
        untrusting.close()
        monkeypatch.setenv("SSL_CERT_FILE", str(certificate))
        trusting = Wire()
        assert orjson.loads(post(trusting, url, BODY))["output_ids"] == [0, 1, 2, 3]
        post(trusting, url, BODY)
        trusting.close()
    assert len(recorder.seen) == 2 and recorder.seen[0].port == recorder.seen[1].port


def test_a_server_that_does_not_answer_in_time_is_a_wire_error(server: tuple[str, Recorder]) -> None:
    url, recorder = server
    recorder.delay_s = 1.0
    w = Wire()
    with (
        pytest.raises(WireError),
        w.post(url, "/generate", orjson.dumps(BODY), timeout_s=0.2, connect_timeout_s=1) as exchange,
    ):
        exchange.response.read()
    w.close()


def test_nothing_listening_is_a_wire_error() -> None:
    w = Wire()
    with (
        pytest.raises(WireError),
        w.post(f"http://127.0.0.1:{free_port()}", "/generate", b"{}", timeout_s=1, connect_timeout_s=1),
    ):
        pass
    w.close()


def test_a_closed_wire_opens_no_connection(server: tuple[str, Recorder]) -> None:
    url, recorder = server
    w = Wire()
    w.close()
    with pytest.raises(RuntimeError, match="closed"):
        post(w, url, BODY)
    assert recorder.seen == []


def test_generations_stream_over_one_kept_connection(server: tuple[str, Recorder]) -> None:
    url, recorder = server
    sampling = {"max_new_tokens": 8, "stream_interval": 4}
    with SGLangClient() as client:
        gens = [
            client.generate(url, rid=f"{i:032x}", sampling_params=sampling, input_ids=[1, 2])
            for i in range(3)
        ]
    assert [g.output_ids for g in gens] == [list(range(8))] * 3
    assert [s.body["stream"] for s in recorder.seen] == [True] * 3
    assert len({s.port for s in recorder.seen}) == 1  # each stream read to its end: the connection kept


def test_a_stopped_stream_whose_server_never_ends_it_is_cut_after_the_abort_grace(
    server: tuple[str, Recorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server takes the abort (200) but keeps the stream open: the read must not wait for the request
    timeout (20 s here), only for the grace; the connection is then closed, not reused."""
    url, recorder = server
    recorder.stall_s = 30.0
    monkeypatch.setattr(client_module, "ABORT_GRACE_S", 0.3)
    with SGLangClient() as client:
        started = time.monotonic()
        gen = client.generate(
            url,
            rid="a" * 32,
            sampling_params={"max_new_tokens": 8, "stream_interval": 4},
            input_ids=[1, 2],
            timeout_s=20,
            on_tokens=lambda n: False,
        )
        elapsed = time.monotonic() - started
        recorder.stall_s = 0.0
        client.generate(url, rid="b" * 32, sampling_params={"max_new_tokens": 4}, input_ids=[1])
    assert elapsed < 5, elapsed
    assert recorder.aborts == ["a" * 32]
    assert gen.stopped_by_us and gen.aborted and gen.output_ids == [0, 1, 2, 3]
    generate_ports = [s.port for s in recorder.seen]
    assert len(generate_ports) == 2 and generate_ports[0] != generate_ports[1]


@pytest.mark.parametrize(
    "chunk",
    [b"data: 5\n\n", b"data: [1, 2]\n\n", b'data: {"error": {"code": "oops", "message": "x"}}\n\n'],
)
def test_a_malformed_stream_chunk_is_a_server_failure_not_a_crash(
    server: tuple[str, Recorder], chunk: bytes
) -> None:
    url, recorder = server
    recorder.chunks = [chunk]
    with SGLangClient() as client, pytest.raises(ServerUnavailable):
        client.generate(url, rid="c" * 32, sampling_params={"max_new_tokens": 4}, input_ids=[1])


def test_errors_name_the_server_without_its_password() -> None:
    url = f"http://fleet:hunter2@127.0.0.1:{free_port()}"
    with SGLangClient() as client, pytest.raises(ServerUnavailable) as caught:
        client.generate(url, rid="d" * 32, sampling_params={"max_new_tokens": 4}, input_ids=[1], timeout_s=2)
    assert "hunter2" not in caught.value.message
    assert "fleet:***@127.0.0.1" in caught.value.message
