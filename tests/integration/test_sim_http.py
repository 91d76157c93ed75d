"""The simulator over real HTTP: SGLang's shapes, status codes, aborts, disconnects and fault knobs."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import orjson
import pytest

from tokenfleet.sim import SimConfig, SimServerThread
from tokenfleet.sim.server import build_parser, parse_config
from workers.sglang.protocol import context_length_error, context_overflow_error, unknown_sampling_key_error

pytestmark = pytest.mark.integration

FAST_STEP_S = 0.002


@contextmanager
def sim_server(**config: Any) -> Iterator[str]:
    config.setdefault("step_time_s", FAST_STEP_S)
    with SimServerThread(SimConfig(port=0, **config)) as server:
        yield server.url


@contextmanager
def sim_client(**config: Any) -> Iterator[httpx.Client]:
    with sim_server(**config) as url, httpx.Client(base_url=url, timeout=10) as client:
        yield client


@pytest.fixture(scope="module")
def shared_url() -> Iterator[str]:
    with sim_server(fixed_output_len=20) as url:
        yield url


@pytest.fixture
def client(shared_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=shared_url, timeout=10) as client:
        yield client


def generate(client: httpx.Client, **body: Any) -> httpx.Response:
    return client.post("/generate", json=body)


def stream_events(client: httpx.Client, **body: Any) -> list[Any]:
    """Every ``data:`` payload of a streamed /generate, ``[DONE]`` kept as the string."""
    events: list[Any] = []
    with client.stream("POST", "/generate", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                payload = line.removeprefix("data: ")
                events.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return events


def words(token_ids: list[int]) -> str:
    return "".join(f" w{token}" for token in token_ids)


def wait_until(condition: Callable[[], bool], timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def stats(client: httpx.Client, **params: Any) -> dict[str, Any]:
    reply = client.get("/sim/stats", params=params)
    assert reply.status_code == 200
    return reply.json()


# --- /generate -------------------------------------------------------------------------------------


def test_generate_answers_output_ids_text_and_meta_info(client: httpx.Client) -> None:
    reply = generate(client, input_ids=[10, 11, 12], rid="plain-1", sampling_params={"max_new_tokens": 64})
    assert reply.status_code == 200
    body = reply.json()
    meta = body["meta_info"]
    assert len(body["output_ids"]) == 21
    assert body["output_ids"][-1] == 2
    assert body["text"] == words(body["output_ids"][:-1])
    assert meta["finish_reason"] == {"type": "stop", "matched": 2}
    assert meta["id"] == "plain-1"
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (3, 21, 0)
    assert meta["num_retractions"] == 0
    assert meta["e2e_latency"] > 0


def test_max_new_tokens_ends_with_a_length_reason(client: httpx.Client) -> None:
    body = generate(client, input_ids=[1], sampling_params={"max_new_tokens": 5}).json()
    assert len(body["output_ids"]) == 5
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert body["text"] == words(body["output_ids"])


def test_missing_max_new_tokens_defaults_to_128_like_sglang(client: httpx.Client) -> None:
    body = generate(client, input_ids=[1], sampling_params={"ignore_eos": True}).json()
    assert body["meta_info"]["completion_tokens"] == 128
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 128}


def test_same_prompt_gives_the_same_output_and_text_is_tokenized_as_bytes_plus_three(
    client: httpx.Client,
) -> None:
    params = {"max_new_tokens": 64}
    by_text = generate(client, text="abc", sampling_params=params).json()
    by_ids = generate(client, input_ids=[100, 101, 102], sampling_params=params).json()
    again = generate(client, text="abc", sampling_params=params).json()
    other = generate(client, text="abd", sampling_params=params).json()
    assert by_text["output_ids"] == by_ids["output_ids"] == again["output_ids"]
    assert by_text["text"] == again["text"]
    assert other["output_ids"] != by_text["output_ids"]


def test_stop_token_ids_stop_at_the_matched_token(client: httpx.Client) -> None:
    free = generate(client, input_ids=[7], sampling_params={"max_new_tokens": 64}).json()["output_ids"]
    stop_id = free[4]
    body = generate(
        client, input_ids=[7], sampling_params={"max_new_tokens": 64, "stop_token_ids": [stop_id]}
    )
    output_ids = body.json()["output_ids"]
    assert output_ids == free[: free.index(stop_id) + 1]
    assert body.json()["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert body.json()["text"] == words(output_ids[:-1])


def test_missing_rid_gets_a_uuid4_hex(client: httpx.Client) -> None:
    rid = generate(client, input_ids=[1], sampling_params={"max_new_tokens": 1}).json()["meta_info"]["id"]
    assert uuid.UUID(hex=rid).hex == rid


# --- streaming -------------------------------------------------------------------------------------


def test_streaming_sends_cumulative_chunks_then_done(client: httpx.Client) -> None:
    events = stream_events(client, input_ids=[4, 5], sampling_params={"max_new_tokens": 64})
    chunks, done = events[:-1], events[-1]
    assert done == "[DONE]"
    assert len(chunks) == 21
    final_ids = chunks[-1]["output_ids"]
    for count, chunk in enumerate(chunks, start=1):
        assert chunk["output_ids"] == final_ids[:count]
        assert chunk["meta_info"]["completion_tokens"] == count
    assert all(chunk["meta_info"]["finish_reason"] is None for chunk in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    assert chunks[-2]["text"] == chunks[-1]["text"] == words(final_ids[:-1])
    assert "e2e_latency" in chunks[-1]["meta_info"]
    plain = generate(client, input_ids=[4, 5], sampling_params={"max_new_tokens": 64}).json()
    assert plain["output_ids"] == final_ids


def test_zero_max_new_tokens_streams_one_final_chunk(client: httpx.Client) -> None:
    events = stream_events(client, input_ids=[9], sampling_params={"max_new_tokens": 0})
    assert events[-1] == "[DONE]"
    assert [chunk["output_ids"] for chunk in events[:-1]] == [[]]
    assert events[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_the_first_token_is_streamed_at_once_then_one_chunk_per_interval_then_the_final(
    client: httpx.Client,
) -> None:
    params = {"max_new_tokens": 10, "stream_interval": 4}
    chunks = stream_events(client, input_ids=[9], sampling_params=params)[:-1]
    assert [chunk["meta_info"]["completion_tokens"] for chunk in chunks] == [1, 5, 9, 10]
    assert "response_sent_to_client_ts" in chunks[0]["meta_info"]
    assert "response_sent_to_client_ts" not in chunks[1]["meta_info"]
    assert {"weight_versions", "e2e_latency"} <= chunks[-1]["meta_info"].keys()


def test_server_interval_applies_when_the_request_sets_none() -> None:
    with sim_client(stream_interval=8, fixed_output_len=30) as client:
        chunks = stream_events(client, input_ids=[9], sampling_params={"max_new_tokens": 20})[:-1]
    assert [chunk["meta_info"]["completion_tokens"] for chunk in chunks] == [1, 9, 17, 20]


def test_incremental_server_streams_output_id_and_text_deltas() -> None:
    with sim_client(incremental_streaming_output=True, fixed_output_len=9) as client:
        chunks = stream_events(
            client, input_ids=[3], sampling_params={"max_new_tokens": 64, "stream_interval": 3}
        )
        plain = generate(client, input_ids=[3], sampling_params={"max_new_tokens": 64}).json()
    deltas = [chunk["output_ids"] for chunk in chunks[:-1]]
    assert [len(delta) for delta in deltas] == [1, 3, 3, 3]
    assert [chunk["meta_info"]["completion_tokens"] for chunk in chunks[:-1]] == [1, 4, 7, 10]
    assert list(itertools.chain.from_iterable(deltas)) == plain["output_ids"]
    assert "".join(chunk["text"] for chunk in chunks[:-1]) == plain["text"]


def test_sglang_04_mode_omits_output_ids() -> None:
    with sim_client(omit_output_ids=True, fixed_output_len=3) as client:
        body = generate(client, input_ids=[3], sampling_params={"max_new_tokens": 8}).json()
        chunks = stream_events(client, input_ids=[3], sampling_params={"max_new_tokens": 8})
    assert "output_ids" not in body
    assert body["text"].count(" w") == 3
    assert all("output_ids" not in chunk for chunk in chunks[:-1])


# --- errors ----------------------------------------------------------------------------------------


def test_unknown_sampling_key_is_a_400_with_a_string_error(client: httpx.Client) -> None:
    reply = generate(client, input_ids=[1], sampling_params={"max_tokens": 5})
    assert reply.status_code == 400
    assert reply.json() == {"error": unknown_sampling_key_error("max_tokens")}


def test_prompt_as_long_as_the_context_is_a_400_with_a_message() -> None:
    with sim_client(context_length=16) as client:
        too_long = generate(client, input_ids=[5] * 16, sampling_params={"max_new_tokens": 1})
        overflow = generate(client, input_ids=[5] * 10, sampling_params={"max_new_tokens": 7})
        fits = generate(client, input_ids=[5] * 10, sampling_params={"max_new_tokens": 6})
    assert too_long.status_code == 400
    assert too_long.json() == {"error": {"message": context_length_error(16, 16)}}
    assert overflow.status_code == 400
    assert overflow.json() == {"error": {"message": context_overflow_error(10, 7, 16)}}
    assert fits.status_code == 200


def test_malformed_requests_are_400s(client: httpx.Client) -> None:
    batch = generate(client, input_ids=[[1], [2]], sampling_params={"max_new_tokens": 1})
    empty = generate(client, sampling_params={"max_new_tokens": 1})
    not_json = client.post("/generate", content=b"{", headers={"content-type": "application/json"})
    assert batch.status_code == empty.status_code == not_json.status_code == 400
    assert empty.json() == {
        "error": {"message": "Either text, input_ids or input_embeds should be provided."}
    }


def test_a_duplicate_in_flight_rid_is_a_400() -> None:
    with sim_client() as client:
        body = {
            "input_ids": [1],
            "rid": "dup-1",
            "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True},
        }
        with client.stream("POST", "/generate", json={**body, "stream": True}) as first:
            lines = first.iter_lines()  # keep a reference: a collected iterator closes the connection
            next(lines)
            duplicate = client.post("/generate", json=body)
            client.post("/abort_request", json={"rid": "dup-1"})
    assert duplicate.status_code == 400
    assert duplicate.json() == {"error": {"message": "Duplicate request ID detected: dup-1"}}


# --- aborts ----------------------------------------------------------------------------------------


async def _post_generate(client: httpx.AsyncClient, rid: str) -> dict[str, Any]:
    params = {"max_new_tokens": 4000, "ignore_eos": True}
    reply = await client.post("/generate", json={"input_ids": [1, 2], "rid": rid, "sampling_params": params})
    assert reply.status_code == 200
    return reply.json()


async def _until_stats(client: httpx.AsyncClient, condition: Callable[[dict[str, Any]], bool]) -> None:
    for _ in range(600):
        if condition((await client.get("/sim/stats")).json()):
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the simulator never reached the expected state")


def test_abort_needs_an_exact_live_rid_and_then_takes_every_live_rid_it_starts() -> None:
    async def scenario(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            rids = ["ds1-7", "ds1-70", "ds1-7_0", "ds1-8"]
            replies = [asyncio.create_task(_post_generate(client, rid)) for rid in rids]
            await _until_stats(client, lambda s: s["running"] == 4 and s["generated_tokens"] > 8)
            prefix_only = await client.post("/abort_request", json={"rid": "ds1-"})
            unknown = await client.post("/abort_request", json={"rid": "nobody"})
            assert (prefix_only.status_code, prefix_only.content) == (unknown.status_code, unknown.content)
            assert (unknown.status_code, unknown.content) == (200, b"")
            await asyncio.sleep(0.02)
            assert not any(reply.done() for reply in replies)
            abort = await client.post("/abort_request", json={"rid": "ds1-7"})
            assert (abort.status_code, abort.content) == (200, b"")
            aborted = await asyncio.gather(*replies[:3])
            await asyncio.sleep(0.02)
            assert not replies[3].done()
            await client.post("/abort_request", json={"abort_all": True})
            survivor = await replies[3]
        for body in [*aborted, survivor]:
            meta = body["meta_info"]
            assert meta["finish_reason"] == {
                "type": "abort",
                "message": "Aborted",
                "status_code": None,
                "err_type": None,
            }
            assert 0 < meta["completion_tokens"] == len(body["output_ids"]) < 4000
            assert meta["prompt_tokens"] == 2

    with sim_server() as url:
        asyncio.run(scenario(url))


def test_an_aborted_running_stream_ends_after_one_more_token_with_its_partial_output() -> None:
    params = {"max_new_tokens": 4000, "ignore_eos": True}
    # Steps of 0.25 s: the abort, sent on another connection after the first chunk, lands within the
    # second step even on a loaded machine (at 0.02 s it had 20-40 ms to do so)
    with sim_client(step_time_s=0.25) as client:
        body = {"input_ids": [1], "rid": "one-more", "stream": True, "sampling_params": params}
        with client.stream("POST", "/generate", json=body) as reply:
            lines = (line for line in reply.iter_lines() if line.startswith("data: "))
            first = orjson.loads(next(lines).removeprefix("data: "))
            client.post("/abort_request", json={"rid": "one-more"})
            rest = [line.removeprefix("data: ") for line in lines]
    assert rest[-1] == "[DONE]"
    chunks = [first, *(orjson.loads(line) for line in rest[:-1])]
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"]["message"] == "Aborted"
    # Sent at the abort: one chunk per token so far, then the token of the one more step.
    assert final["meta_info"]["completion_tokens"] == len(final["output_ids"]) == len(chunks)
    assert len(chunks) <= 3


def test_aborting_a_waiting_request_says_abort_in_waiting_queue_without_prompt_tokens() -> None:
    async def scenario(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            running = asyncio.create_task(_post_generate(client, "run-0"))
            await _until_stats(client, lambda s: s["running"] == 1)
            waiting = asyncio.create_task(_post_generate(client, "wait-0"))
            await _until_stats(client, lambda s: s["waiting"] == 1)
            await client.post("/abort_request", json={"rid": "wait-0"})
            body = await waiting
            await client.post("/abort_request", json={"rid": "run-0"})
            await running
        assert body["output_ids"] == []
        assert body["meta_info"]["finish_reason"]["message"] == "Abort in waiting queue"
        assert "prompt_tokens" not in body["meta_info"]

    with sim_server(max_running_requests=1) as url:
        asyncio.run(scenario(url))


def _assert_generation_stopped(client: httpx.Client, max_tokens: int) -> None:
    wait_until(lambda: stats(client)["running"] == 0)
    before = stats(client)
    time.sleep(0.03)
    after = stats(client)
    assert after["generated_tokens"] == before["generated_tokens"] < max_tokens
    assert (after["aborted"], after["disconnected"]) == (1, 1)


def test_a_streaming_client_that_disconnects_stops_generation() -> None:
    params = {"max_new_tokens": 4000, "ignore_eos": True}
    with sim_client() as client:
        with client.stream(
            "POST", "/generate", json={"input_ids": [1], "stream": True, "sampling_params": params}
        ) as reply:
            lines = reply.iter_lines()
            assert next(lines).startswith("data: ")
        _assert_generation_stopped(client, 4000)


def test_a_plain_client_that_disconnects_stops_generation() -> None:
    params = {"max_new_tokens": 4000, "ignore_eos": True}
    with sim_client() as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post("/generate", json={"input_ids": [1], "sampling_params": params}, timeout=0.1)
        _assert_generation_stopped(client, 4000)


# --- fault knobs and stats -------------------------------------------------------------------------


def test_error_rate_answers_503_with_sglang_error_shape() -> None:
    with sim_client(error_rate=1.0) as client:
        reply = generate(client, input_ids=[1], sampling_params={"max_new_tokens": 4})
        assert stats(client)["errors_503"] == 1
    assert reply.status_code == 503
    body = reply.json()
    assert (body["object"], body["code"]) == ("error", 503)
    assert isinstance(body["message"], str)


def test_drop_rate_cuts_the_connection_before_the_body_or_mid_stream() -> None:
    params = {"max_new_tokens": 50, "ignore_eos": True}
    with sim_client(drop_rate=1.0) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            generate(client, input_ids=[1], sampling_params=params)
        with pytest.raises(httpx.RemoteProtocolError):
            stream_events(client, input_ids=[2], sampling_params=params)
        counts = stats(client)
    assert counts["dropped"] == 2
    assert counts["finished"] == 0


def test_abort_rate_aborts_requests_with_a_retraction() -> None:
    with sim_client(abort_rate=1.0) as client:
        body = generate(
            client, input_ids=[1], sampling_params={"max_new_tokens": 50, "ignore_eos": True}
        ).json()
    meta = body["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert meta["finish_reason"]["message"] == "Abort in waiting queue"
    assert meta["num_retractions"] == 1
    assert len(body["output_ids"]) == meta["completion_tokens"] < 50


def test_fault_knobs_change_at_run_time() -> None:
    with sim_client() as client:
        updated = client.post("/sim/config", json={"error_rate": 1.0, "step_time_s": 0.001})
        failing = generate(client, input_ids=[1], sampling_params={"max_new_tokens": 2})
        client.post("/sim/config", json={"error_rate": 0})
        passing = generate(client, input_ids=[1], sampling_params={"max_new_tokens": 2})
        refused = client.post("/sim/config", json={"port": 1})
    assert updated.json()["error_rate"] == 1.0
    assert updated.json()["step_time_s"] == 0.001
    assert (failing.status_code, passing.status_code, refused.status_code) == (503, 200, 400)


def test_faults_repeat_after_a_reset_with_the_same_seed() -> None:
    def statuses(client: httpx.Client) -> list[int]:
        params = {"max_new_tokens": 1}
        return [generate(client, input_ids=[i], sampling_params=params).status_code for i in range(12)]

    with sim_client(error_rate=0.5, seed=3) as client:
        first = statuses(client)
        client.post("/sim/reset")
        again = statuses(client)
    assert first == again
    assert {200, 503} == set(first)


def test_sim_stats_count_generated_tokens_per_dataset_tag() -> None:
    with sim_client() as client:
        completions: dict[str, int] = {"dataset1": 0, "dataset2": 0}
        for tag, count in (("dataset1", 3), ("dataset2", 2)):
            for i in range(count):
                body = generate(
                    client, input_ids=[i], rid=tag + uuid.uuid4().hex, sampling_params={"max_new_tokens": 30}
                )
                completions[tag] += body.json()["meta_info"]["completion_tokens"]
        counts = stats(client)
        short = stats(client, prefix_len=7)
        totals = client.get("/sim/stats", params={"totals": "1"}).json()
        reset = client.post("/sim/reset").json()
    assert counts["by_prefix"] == completions
    # the counters alone, for a reader that polls them: the same figures, no maps by prefix
    assert totals == {k: v for k, v in counts.items() if not k.endswith("by_prefix")}
    assert totals["generated_tokens"] == sum(completions.values())
    assert short["by_prefix"] == {"dataset": sum(completions.values())}
    assert counts["generated_tokens"] == sum(completions.values())
    assert (counts["requests"], counts["finished"], counts["running"], counts["waiting"]) == (5, 5, 0, 0)
    assert (reset["generated_tokens"], reset["requests"], reset["by_prefix"]) == (0, 0, {})


# --- the other endpoints ---------------------------------------------------------------------------


def test_server_info_reports_launch_arguments_as_null_unless_given_and_the_batch_in_force() -> None:
    with sim_client() as client:
        default = client.get("/server_info").json()
        models = client.get("/v1/models").json()
    assert (default["max_running_requests"], default["context_length"]) == (None, None)
    assert [state["effective_max_running_requests_per_dp"] for state in default["internal_states"]] == [256]
    assert {"last_gen_throughput", "memory_usage"} <= default["internal_states"][0].keys()
    assert default["max_req_input_len"] == min(8192, default["max_total_num_tokens"]) - 6
    assert default["version"] == "0.5.23-sim"
    assert models["data"][0]["max_model_len"] == 8192


def test_info_endpoints_report_the_model_and_the_limits_given_at_launch() -> None:
    with sim_client(
        context_length=4096, max_running_requests=32, dp_size=2, model_path="/models/m", tokenizer_path="/tok"
    ) as client:
        assert client.get("/health").status_code == 200
        assert client.get("/health_generate").status_code == 200
        assert client.get("/ready").status_code == client.get("/ping").status_code == 200
        model_info = client.get("/model_info").json()
        server_info = client.get("/server_info").json()
        deprecated = client.get("/get_server_info").json()
        get_load = client.get("/get_load")
        loads = client.get("/v1/loads").json()
        models = client.get("/v1/models").json()
    assert model_info["model_path"] == "/models/m"
    assert model_info["tokenizer_path"] == "/tok"
    assert model_info["is_generation"] is True
    assert {"served_model_name", "weight_version"} <= model_info.keys()
    assert (server_info["max_running_requests"], server_info["context_length"]) == (32, 4096)
    assert (server_info["tp_size"], server_info["dp_size"]) == (1, 2)
    assert [s["effective_max_running_requests_per_dp"] for s in server_info["internal_states"]] == [16, 16]
    assert server_info["max_req_input_len"] == 4096 - 6
    assert deprecated["max_req_input_len"] == server_info["max_req_input_len"]
    assert get_load.status_code == 404
    assert [load["dp_rank"] for load in loads["loads"]] == [0, 1]
    assert loads["loads"][0]["num_running_reqs"] == loads["loads"][0]["num_waiting_reqs"] == 0
    assert models["data"][0]["max_model_len"] == 4096


def test_64_concurrent_streams_finish_in_about_their_step_budget() -> None:
    # 64 streams of a chunk per 20 ms step: 3,200 chunks/s, which one core of this kind of machine serves
    # (at 5 ms steps, 12,800 chunks/s, the simulator's own CPU set the pace, not its batching). One after
    # another they would take 64 times the budget.
    step_s, tokens, streams = 0.02, 40, 64

    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {
            "input_ids": [i],
            "stream": True,
            "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True},
        }
        chunks = 0
        async with client.stream("POST", "/generate", json=body) as reply:
            async for line in reply.aiter_lines():
                chunks += line.startswith("data: {")
        return chunks

    async def scenario(url: str) -> float:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            started = time.perf_counter()
            chunks = await asyncio.gather(*(one(client, i) for i in range(streams)))
            elapsed = time.perf_counter() - started
        assert chunks == [tokens] * streams
        return elapsed

    with sim_server(step_time_s=step_s) as url:
        elapsed = asyncio.run(scenario(url))
    budget = tokens * step_s
    # Batched: about the budget (0.9 s measured; each step's CPU adds to its sleep on a loaded machine).
    # One stream after another would take 64 budgets (51 s); 16 tells them apart and leaves room for a
    # loaded machine (the client and the simulator share this process's CPU).
    assert budget * 0.9 < elapsed < budget * 16


def test_every_config_field_has_a_cli_flag() -> None:
    argv = [
        "--port",
        "0",
        "--step-time-s",
        "0.5",
        "--fixed-output-len",
        "7",
        "--incremental-streaming-output",
    ]
    argv += ["--error-rate", "0.25", "--tokenizer-path", "/tok", "--omit-output-ids"]
    config = parse_config(argv)
    assert config == SimConfig(
        port=0,
        step_time_s=0.5,
        fixed_output_len=7,
        incremental_streaming_output=True,
        error_rate=0.25,
        tokenizer_path="/tok",
        omit_output_ids=True,
    )
    flags = build_parser().format_help()
    assert all("--" + f.name.replace("_", "-") in flags for f in dataclasses.fields(SimConfig))


def test_the_cli_announces_its_url_and_stops_on_sigterm() -> None:
    command = [sys.executable, "-m", "tokenfleet.sim", "--port", "0", "--step-time-s", "0.001"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as process:
        try:
            line = process.stdout.readline() if process.stdout else ""
            assert line.startswith("tokenfleet sim listening on http://127.0.0.1:")
            url = line.split()[-1]
            assert httpx.get(url + "/health").status_code == 200
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=10) == 0
        finally:
            if process.poll() is None:
                process.kill()
