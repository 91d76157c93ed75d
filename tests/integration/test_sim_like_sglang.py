"""The simulator behaves like the real sglang 0.5.23 server over real HTTP where the real one was observed:
errors inside 200 streams, keys, the vocabulary crash, type-strict sampling params, batches of samples,
``/health`` through the engine and ``/metrics``."""

from __future__ import annotations

import json
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tokenfleet.sim import SimConfig, SimServerThread
from workers.sglang.protocol import context_length_error, context_overflow_error

pytestmark = pytest.mark.integration

FAST_STEP_S = 0.002
LONG = {"max_new_tokens": 4000, "ignore_eos": True}


@contextmanager
def sim_client(headers: dict[str, str] | None = None, **config: Any) -> Iterator[httpx.Client]:
    config.setdefault("step_time_s", FAST_STEP_S)
    with (
        SimServerThread(SimConfig(port=0, **config)) as server,
        httpx.Client(base_url=server.url, timeout=10, headers=headers) as client,
    ):
        yield client


def stream_events(client: httpx.Client, **body: Any) -> list[Any]:
    """Every ``data:`` payload of a streamed /generate (status 200 required), ``[DONE]`` kept as is."""
    events: list[Any] = []
    with client.stream("POST", "/generate", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                payload = line.removeprefix("data: ")
                events.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return events


def error_chunk(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "code": 400, "retryable": False}}


# --- errors inside a 200 stream ----------------------------------------------------------------------


def test_context_errors_are_a_400_plainly_and_an_error_chunk_in_a_200_stream() -> None:
    with sim_client(context_length=16) as client:
        too_long = stream_events(client, input_ids=[5] * 16, sampling_params={"max_new_tokens": 1})
        overflow = stream_events(client, input_ids=[5] * 10, sampling_params={"max_new_tokens": 7})
        plain = client.post(
            "/generate", json={"input_ids": [5] * 16, "sampling_params": {"max_new_tokens": 1}}
        )
    assert too_long == [error_chunk(context_length_error(16, 16)), "[DONE]"]
    assert overflow == [error_chunk(context_overflow_error(10, 7, 16)), "[DONE]"]
    assert plain.status_code == 400


def test_a_duplicate_in_flight_rid_is_an_error_chunk_in_a_200_stream() -> None:
    with sim_client() as client:
        body = {"input_ids": [1], "rid": "dup-2", "sampling_params": LONG}
        with client.stream("POST", "/generate", json={**body, "stream": True}) as first:
            lines = first.iter_lines()
            next(lines)
            duplicate = stream_events(client, **body)
            client.post("/abort_request", json={"rid": "dup-2"})
    assert duplicate == [error_chunk("Duplicate request ID detected: dup-2"), "[DONE]"]


def test_a_prompt_over_max_req_input_len_ends_as_an_abort_with_status_400() -> None:
    with sim_client(context_length=64, max_total_tokens=32) as client:
        limit = client.get("/server_info").json()["max_req_input_len"]
        events = stream_events(client, input_ids=[5] * limit, sampling_params={"max_new_tokens": 1})
        plain = client.post(
            "/generate", json={"input_ids": [5] * limit, "sampling_params": {"max_new_tokens": 1}}
        )
    assert limit == 26
    assert events[-1] == "[DONE]"
    reason = events[-2]["meta_info"]["finish_reason"]
    assert (reason["type"], reason["status_code"], reason["err_type"]) == ("abort", 400, "BadRequestError")
    assert reason["message"].startswith(f"Input length ({limit} tokens) exceeds the maximum allowed length")
    assert plain.status_code == 200
    assert plain.json()["meta_info"]["finish_reason"] == reason


def test_an_invalid_stop_regex_ends_as_an_abort_with_status_400_on_the_last_chunk() -> None:
    with sim_client() as client:
        events = stream_events(
            client, input_ids=[5], sampling_params={"max_new_tokens": 50, "stop_regex": "("}
        )
    assert events[-1] == "[DONE]"
    reason = events[-2]["meta_info"]["finish_reason"]
    assert (reason["type"], reason["status_code"], reason["err_type"]) == ("abort", 400, "BadRequestError")
    assert reason["message"].startswith("invalid stop_regex '('")
    assert all(chunk["meta_info"]["finish_reason"] is None for chunk in events[:-2])


def test_a_full_queue_is_a_503_plainly_and_a_503_abort_in_a_200_stream() -> None:
    first = {"input_ids": [1], "stream": True, "sampling_params": LONG}
    with (
        sim_client(max_running_requests=1, max_queued_requests=1) as client,
        client.stream("POST", "/generate", json=first) as running,
    ):
        running_lines = running.iter_lines()
        next(running_lines)  # a token: it runs, so the next request waits
        with client.stream("POST", "/generate", json={**first, "input_ids": [2]}) as queued:
            assert queued.status_code == 200
            plain = client.post(
                "/generate", json={"input_ids": [3], "sampling_params": {"max_new_tokens": 1}}
            )
            streamed = stream_events(client, input_ids=[4], sampling_params={"max_new_tokens": 1})
            client.post("/abort_request", json={"abort_all": True})
    assert plain.status_code == 503
    assert plain.json() == {"object": "error", "message": "The request queue is full.", "code": 503}
    assert streamed[-1] == "[DONE]"
    assert streamed[-2]["meta_info"]["finish_reason"]["status_code"] == 503


def test_a_request_waiting_too_long_is_a_503() -> None:
    first = {"input_ids": [1], "stream": True, "sampling_params": LONG}
    with (
        sim_client(max_running_requests=1, req_waiting_timeout_s=0.05) as client,
        client.stream("POST", "/generate", json=first) as running,
    ):
        running_lines = running.iter_lines()
        next(running_lines)
        waited = client.post("/generate", json={"input_ids": [2], "sampling_params": {"max_new_tokens": 1}})
        client.post("/abort_request", json={"abort_all": True})
    assert waited.status_code == 503
    assert waited.json()["message"] == "Request waiting timeout reached."


# --- keys --------------------------------------------------------------------------------------------


def test_an_api_key_guards_every_route_but_health_ready_and_metrics() -> None:
    with sim_client(api_key="k-123", enable_metrics=True) as client:
        params = {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}
        without = client.post("/generate", json=params)
        wrong = client.post("/generate", json=params, headers={"Authorization": "Bearer nope"})
        right = client.post("/generate", json=params, headers={"Authorization": "Bearer k-123"})
        info = client.get("/server_info")
        opened = [
            client.get(path).status_code for path in ("/health", "/health_generate", "/ready", "/metrics")
        ]
        config = client.get("/sim/config", headers={"Authorization": "Bearer k-123"}).json()
        server_info = client.get("/server_info", headers={"Authorization": "Bearer k-123"}).text
    assert (without.status_code, wrong.status_code, right.status_code, info.status_code) == (
        401,
        401,
        200,
        401,
    )
    assert without.json() == {"error": "Unauthorized"}
    assert opened == [200, 200, 200, 200]
    assert "k-123" not in json.dumps(config) and "k-123" not in server_info


def test_with_an_admin_key_only_the_admin_key_may_abort() -> None:
    with sim_client(api_key="user", admin_api_key="admin") as client:
        user = client.post(
            "/abort_request", json={"abort_all": True}, headers={"Authorization": "Bearer user"}
        )
        admin = client.post(
            "/abort_request", json={"abort_all": True}, headers={"Authorization": "Bearer admin"}
        )
        admin_generates = client.post(
            "/generate",
            json={"input_ids": [1], "sampling_params": {"max_new_tokens": 1}},
            headers={"Authorization": "Bearer admin"},
        )
    assert (user.status_code, admin.status_code, admin_generates.status_code) == (401, 200, 401)


# --- the vocabulary ----------------------------------------------------------------------------------


def test_model_info_names_a_local_model_folder_whose_config_has_the_vocab_size() -> None:
    with sim_client(vocab_size=5000) as client:
        info = client.get("/model_info").json()
        folder = Path(info["model_path"])
        model_config = json.loads((folder / "config.json").read_text())
    assert folder.is_absolute()
    assert info["tokenizer_path"] == info["model_path"]
    assert model_config["vocab_size"] == 5000
    assert not folder.exists()  # removed when the server stops


def test_an_input_id_outside_the_vocabulary_kills_the_server_and_every_stream_in_flight() -> None:
    command = [sys.executable, "-m", "tokenfleet.sim", "--port", "0", "--step-time-s", "0.002"]
    command += ["--vocab-size", "1000"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        try:
            line = process.stdout.readline() if process.stdout else ""
            url = line.split()[-1]
            with httpx.Client(base_url=url, timeout=10) as client:
                body = {"input_ids": [1], "stream": True, "sampling_params": LONG}
                with client.stream("POST", "/generate", json=body) as in_flight:
                    lines = in_flight.iter_lines()
                    assert next(lines).startswith("data: ")
                    with pytest.raises(httpx.TransportError):
                        client.post(
                            "/generate",
                            json={"input_ids": [5, 1000], "sampling_params": {"max_new_tokens": 1}},
                        )
                    with pytest.raises(httpx.TransportError):
                        list(lines)
            assert process.wait(timeout=10) != 0
            stderr = process.stderr.read() if process.stderr else ""
            assert "IndexError" in stderr and "1000" in stderr
        finally:
            if process.poll() is None:
                process.kill()


def test_the_crash_can_be_switched_off_for_a_400_abort_instead() -> None:
    with sim_client(vocab_size=1000, crash_on_bad_token_id=False) as client:
        bad = client.post("/generate", json={"input_ids": [1000], "sampling_params": {"max_new_tokens": 1}})
        good = client.post("/generate", json={"input_ids": [999], "sampling_params": {"max_new_tokens": 1}})
    assert bad.json()["meta_info"]["finish_reason"]["status_code"] == 400
    assert good.status_code == 200


def test_the_default_vocabulary_covers_the_bundled_examples() -> None:
    examples = Path(__file__).parents[2] / "tokenfleet" / "examples"
    ids = [
        token
        for path in examples.glob("*.jsonl")
        for row in map(json.loads, path.read_text().splitlines())
        for token in row.get("input_ids", [])
    ]
    assert ids and max(ids) < SimConfig().vocab_size


# --- the request contract ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "error"),
    [
        ({"max_new_tokens": 100.0}, "invalid type: floating point `100.0`, expected i64"),
        ({"regex": 5}, "invalid type: integer `5`, expected a string"),
        ({"temperature": "0.7"}, 'invalid type: string "0.7", expected f64'),
        ({"ignore_eos": 1}, "invalid type: integer `1`, expected a boolean"),
    ],
)
def test_sampling_params_of_the_wrong_type_are_a_400(params: dict[str, Any], error: str) -> None:
    with sim_client() as client:
        reply = client.post("/generate", json={"input_ids": [1], "sampling_params": params})
    assert reply.status_code == 400
    assert reply.json() == {"error": error}


def test_beam_width_watermark_choice_and_integer_temperatures_are_accepted() -> None:
    params = {"max_new_tokens": 2, "temperature": 1, "watermark": {"enabled": False}, "choice": ["a"]}
    with sim_client() as client:
        reply = client.post("/generate", json={"input_ids": [1], "sampling_params": params, "ignored_key": 1})
    assert reply.status_code == 200


# --- n > 1 -------------------------------------------------------------------------------------------


def test_n_samples_are_a_batch_with_sub_rids_and_interleaved_indexed_chunks() -> None:
    params = {"max_new_tokens": 6, "ignore_eos": True, "n": 3}
    with sim_client() as client:
        plain = client.post(
            "/generate", json={"input_ids": [4], "rid": "b", "sampling_params": params}
        ).json()
        single = client.post(
            "/generate", json={"input_ids": [4], "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}
        ).json()
        events = stream_events(client, input_ids=[4], rid="s", sampling_params=params)
    assert [body["meta_info"]["id"] for body in plain] == ["b_0", "b_1", "b_2"]
    assert [body["index"] for body in plain] == [0, 1, 2]
    assert plain[0]["output_ids"] == single["output_ids"]
    assert len({tuple(body["output_ids"]) for body in plain}) == 3
    chunks = events[:-1]
    assert events[-1] == "[DONE]"
    assert {chunk["meta_info"]["id"]: chunk["index"] for chunk in chunks} == {"s_0": 0, "s_1": 1, "s_2": 2}
    assert [chunk["index"] for chunk in chunks[:3]] == [0, 1, 2]  # interleaved, not one after the other
    finals = [chunk for chunk in chunks if chunk["meta_info"]["finish_reason"]]
    assert [chunk["output_ids"] for chunk in finals] == [body["output_ids"] for body in plain]


# --- /health and /metrics ----------------------------------------------------------------------------


def test_health_runs_through_the_engine_and_is_503_when_no_step_comes_in_time() -> None:
    with sim_client(health_check_timeout_s=0.2) as client:
        assert client.get("/health").status_code == 200
        client.post("/sim/config", json={"step_time_s": 5.0})
        assert client.get("/health").status_code == 503
        assert client.get("/sim/stats").json()["requests"] == 0  # the probe is in no counter


def test_metrics_are_404_unless_enabled_and_count_the_servers_tokens() -> None:
    with sim_client() as client:
        assert client.get("/metrics").status_code == 404
    with sim_client(enable_metrics=True) as client:
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
        for _ in range(2):
            client.post("/generate", json=body)
        text = client.get("/metrics").text
    samples = {
        line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines() if not line.startswith("#")
    }
    assert samples["sglang:prompt_tokens_total"] == 6
    assert samples["sglang:generation_tokens_total"] == 10
    assert samples["sglang:num_running_reqs"] == samples["sglang:num_queue_reqs"] == 0


# --- connections ----------------------------------------------------------------------------------------


def test_hundreds_of_connections_opened_while_the_server_is_busy_are_queued_not_dropped() -> None:
    """SGLang's uvicorn listens with a backlog of 2,048: connections a busy server has not accepted yet
    wait in the kernel's queue. aiohttp's default of 128 dropped the rest of a fleet's first burst (their
    SYNs are retried a second later): runs at 1,024 in flight took seconds longer to ramp up, the plain
    client's and the fleet's alike, by chance. The simulator's loop is held still while the connections
    are made, so only the listen queue can complete them."""
    wanted = 600  # a fleet's first burst; well past aiohttp's 128, and within a 1,024-file limit
    with SimServerThread(SimConfig(port=0, step_time_s=FAST_STEP_S)) as server:
        loop = server._loop  # the only way to make the server busy at a known moment
        assert loop is not None
        held = threading.Event()
        loop.call_soon_threadsafe(lambda: (held.set(), time.sleep(2.0)))
        assert held.wait(5)
        sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(wanted)]
        try:
            for s in sockets:
                s.setblocking(False)
                s.connect_ex(("127.0.0.1", server.port))
            # poll, not select: the suite's process may hold file numbers past select's 1,024
            poller = select.poll()
            pending = {s.fileno(): s for s in sockets}
            for fd in pending:
                poller.register(fd, select.POLLOUT)
            deadline = time.monotonic() + 1.0
            while pending and time.monotonic() < deadline:
                for fd, _ in poller.poll(50):
                    if pending[fd].getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                        poller.unregister(fd)
                        del pending[fd]
            connected = wanted - len(pending)
        finally:
            for s in sockets:
                s.close()
    assert connected == wanted, f"{wanted - connected} of {wanted} connections were not queued"


def test_the_request_log_has_a_line_per_finished_request_with_its_times_tokens_and_end(
    tmp_path: Path,
) -> None:
    log = tmp_path / "requests.jsonl"
    with sim_client(request_log=str(log)) as client:
        client.get("/health")  # the probe is in no log
        capped = {
            "input_ids": [5, 6, 7],
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
            "rid": "r-cap",
        }
        whole = {"input_ids": [5, 6, 8], "sampling_params": {"max_new_tokens": 4096}, "rid": "r-whole"}
        answers = [client.post("/generate", json=body).json() for body in (capped, whole)]
    lines = [orjson.loads(line) for line in log.read_bytes().splitlines()]
    assert [line["rid"] for line in lines] == ["r-cap", "r-whole"]
    for line, answer in zip(lines, answers, strict=True):
        meta = answer["meta_info"]
        assert line["completion_tokens"] == meta["completion_tokens"]
        assert line["prompt_tokens"] == meta["prompt_tokens"] == 3
        assert line["finish"] == meta["finish_reason"]["type"]
        assert line["arrived_s"] <= line["started_s"] <= line["ended_s"]
        assert line["ended_s"] - line["arrived_s"] == pytest.approx(meta["e2e_latency"], abs=0.01)
    assert [line["finish"] for line in lines] == ["length", "stop"]
