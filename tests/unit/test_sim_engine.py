"""The simulator's engine without HTTP: output planning, batching, aborts and faults."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import statistics
from collections.abc import Awaitable, Callable

import pytest

from tokenfleet.sim.engine import (
    FIRST_REGULAR_TOKEN,
    DuplicateRequestError,
    Fault,
    Outcome,
    OverloadedError,
    SamplingSpec,
    SimConfig,
    SimEngine,
    SimRequest,
    detokenize,
    draw_fault,
    plan_output,
    tokenize,
    updated_config,
)
from workers.sglang.protocol import ABORT_MESSAGE_REQUESTED, ABORT_MESSAGE_WAITING_QUEUE

FAST = SimConfig(step_time_s=0.001)


def run_with_engine(config: SimConfig, scenario: Callable[[SimEngine], Awaitable[None]]) -> None:
    async def main() -> None:
        engine = SimEngine(config)
        await engine.start()
        try:
            await asyncio.wait_for(scenario(engine), timeout=5)
        finally:
            await engine.stop()

    asyncio.run(main())


async def until_done(*requests: SimRequest) -> None:
    for request in requests:
        while not request.done:
            await request.wait()


def test_same_prompt_gives_the_same_output_every_time() -> None:
    sampling = SamplingSpec(max_new_tokens=300)
    first = plan_output([11, 12, 13], sampling, SimConfig())
    again = plan_output([11, 12, 13], sampling, SimConfig(seed=99))
    other = plan_output([11, 12, 14], sampling, SimConfig())
    assert first == again
    assert first.token_ids != other.token_ids


def test_natural_stop_ends_with_eos_after_the_wanted_length() -> None:
    plan = plan_output([5], SamplingSpec(max_new_tokens=50), SimConfig(fixed_output_len=7))
    assert len(plan.token_ids) == 8
    assert plan.token_ids[-1] == 2
    assert plan.finish_reason == {"type": "stop", "matched": 2}


def test_max_new_tokens_cuts_the_output_with_a_length_reason() -> None:
    plan = plan_output([5], SamplingSpec(max_new_tokens=7), SimConfig(fixed_output_len=7))
    assert len(plan.token_ids) == 7
    assert 2 not in plan.token_ids
    assert plan.finish_reason == {"type": "length", "length": 7}


def test_length_knobs_do_not_change_which_tokens_come_out() -> None:
    short = plan_output([9, 9], SamplingSpec(max_new_tokens=100), SimConfig(fixed_output_len=10))
    long = plan_output([9, 9], SamplingSpec(max_new_tokens=100), SimConfig(fixed_output_len=50))
    assert long.token_ids[:10] == short.token_ids[:10]


def test_output_tokens_are_regular_ids_below_the_vocab_size() -> None:
    config = SimConfig(vocab_size=40, eos_token_id=7, fixed_output_len=500)
    plan = plan_output([1], SamplingSpec(max_new_tokens=500), config)
    assert all(FIRST_REGULAR_TOKEN <= token < 40 and token != 7 for token in plan.token_ids)


def test_ignore_eos_generates_until_max_new_tokens() -> None:
    config = SimConfig(fixed_output_len=3)
    plan = plan_output([1], SamplingSpec(max_new_tokens=40, ignore_eos=True), config)
    assert len(plan.token_ids) == 40
    assert plan.finish_reason == {"type": "length", "length": 40}


def test_stop_token_ids_end_the_output_at_the_first_match() -> None:
    config = SimConfig(fixed_output_len=100)
    free = plan_output([3, 4], SamplingSpec(max_new_tokens=100), config)
    stop_id = free.token_ids[5]
    plan = plan_output([3, 4], SamplingSpec(max_new_tokens=100, stop_token_ids=frozenset({stop_id})), config)
    first_match = free.token_ids.index(stop_id)
    assert plan.token_ids == free.token_ids[: first_match + 1]
    assert plan.finish_reason == {"type": "stop", "matched": stop_id}


def test_output_lengths_follow_the_configured_lognormal_mean() -> None:
    config = SimConfig(output_len_mean=120, output_len_sigma=0.6)
    rng = random.Random(1)
    lengths = [
        len(plan_output([rng.randrange(1000) for _ in range(8)], SamplingSpec(4000), config).token_ids)
        for _ in range(1500)
    ]
    assert 110 < statistics.mean(lengths) < 132
    assert len(set(lengths)) > 50


def test_text_tokenizes_to_utf8_bytes_plus_three_and_decodes_to_words() -> None:
    assert tokenize("aé", 32000) == [97 + 3, 0xC3 + 3, 0xA9 + 3]
    assert detokenize([5, 17]) == " w5 w17"


def test_config_refuses_out_of_range_values() -> None:
    with pytest.raises(ValueError, match="error_rate"):
        SimConfig(error_rate=1.5)
    with pytest.raises(ValueError, match="max_running_requests"):
        SimConfig(max_running_requests=0)


def test_only_runtime_knobs_can_be_updated() -> None:
    config = updated_config(SimConfig(), {"error_rate": 1, "fixed_output_len": 4})
    assert (config.error_rate, config.fixed_output_len) == (1.0, 4)
    with pytest.raises(ValueError, match="not a runtime knob: port"):
        updated_config(SimConfig(), {"port": 1})
    with pytest.raises(ValueError, match="must be a number"):
        updated_config(SimConfig(), {"drop_rate": "high"})


def test_fault_decisions_are_reproducible_for_a_seed() -> None:
    config = SimConfig(error_rate=0.3, drop_rate=0.3, abort_rate=0.3)
    rng_a, rng_b = random.Random(7), random.Random(7)
    kinds_a = [draw_fault(rng_a, config).kind for _ in range(200)]
    kinds_b = [draw_fault(rng_b, config).kind for _ in range(200)]
    assert kinds_a == kinds_b
    assert set(kinds_a) == set(Fault)


def test_engine_gives_every_running_request_its_whole_plan() -> None:
    async def scenario(engine: SimEngine) -> None:
        requests = [engine.submit(f"r{i}", [i], SamplingSpec(30), None) for i in range(10)]
        await until_done(*requests)
        for request in requests:
            assert request.outcome is Outcome.FINISHED
            assert request.output_ids() == request.plan.token_ids
        assert engine.stats()["generated_tokens"] == sum(len(r.plan.token_ids) for r in requests)

    run_with_engine(FAST, scenario)


def test_engine_runs_at_most_max_running_requests_and_admits_the_rest_in_order() -> None:
    config = SimConfig(step_time_s=0.001, max_running_requests=2, fixed_output_len=100)

    async def scenario(engine: SimEngine) -> None:
        short = engine.submit("short", [0], SamplingSpec(3), None)
        first, second, third = (engine.submit(f"r{i}", [i], SamplingSpec(10), None) for i in range(3))
        await until_done(short)
        assert (first.produced, second.produced, third.produced) == (3, 0, 0)
        assert engine.stats()["waiting"] == 2
        await until_done(first)
        assert (second.produced, third.produced) == (7, 0)
        await until_done(second, third)

    run_with_engine(config, scenario)


def test_a_decode_step_takes_longer_with_each_running_request_where_configured() -> None:
    # 4 running, 5 tokens each: the step that admits them takes what the batch before it held (none), the
    # 4 after it at least 4 x 10 ms each (a lower bound: sleeps are never shorter)
    config = SimConfig(step_time_s=0.0, step_time_per_request_s=0.01, fixed_output_len=5)

    async def scenario(engine: SimEngine) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        requests = [engine.submit(f"r{i}", [i], SamplingSpec(5), None) for i in range(4)]
        await until_done(*requests)
        assert loop.time() - started >= 4 * 4 * 0.01

    run_with_engine(config, scenario)


def test_streaming_requests_are_woken_at_the_first_token_then_every_interval() -> None:
    config = SimConfig(step_time_s=0.001, fixed_output_len=11)

    async def scenario(engine: SimEngine) -> None:
        request = engine.submit("s", [1], SamplingSpec(50), 4)
        seen = []
        while not request.done:
            await request.wait()
            seen.append(request.produced)
        assert seen == [1, 5, 9, 12]

    run_with_engine(config, scenario)


def test_an_in_flight_rid_cannot_be_submitted_twice() -> None:
    async def scenario(engine: SimEngine) -> None:
        request = engine.submit("same", [1], SamplingSpec(5), None)
        with pytest.raises(DuplicateRequestError, match="Duplicate request ID detected: same"):
            engine.submit("same", [2], SamplingSpec(5), None)
        await until_done(request)
        await until_done(engine.submit("same", [2], SamplingSpec(5), None))

    run_with_engine(FAST, scenario)


def test_only_an_exact_live_rid_aborts_and_then_every_live_rid_it_starts() -> None:
    config = SimConfig(step_time_s=0.001, max_running_requests=1)

    async def scenario(engine: SimEngine) -> None:
        running = engine.submit("ds1-7", [1], SamplingSpec(5000, ignore_eos=True), None)
        waiting = engine.submit("ds1-70", [2], SamplingSpec(5000, ignore_eos=True), None)
        other = engine.submit("ds1-8", [3], SamplingSpec(5000, ignore_eos=True), None)
        while running.produced < 3:
            await asyncio.sleep(0.001)
        assert engine.abort("ds1-") == 0  # a prefix alone is no live rid
        assert engine.abort("") == 0
        assert engine.abort("ds1-7") == 2
        assert waiting.finish_reason is not None
        assert waiting.finish_reason["message"] == ABORT_MESSAGE_WAITING_QUEUE
        assert (waiting.produced, waiting.reported_prompt) == (0, False)
        assert not running.done  # a running request gets one more decode step
        produced = running.produced
        await until_done(running)
        assert running.produced == produced + 1
        assert running.finish_reason == {
            "type": "abort",
            "message": ABORT_MESSAGE_REQUESTED,
            "status_code": None,
            "err_type": None,
        }
        assert not other.done
        assert engine.abort(abort_all=True) == 1

    run_with_engine(config, scenario)


def test_an_input_id_outside_the_vocabulary_crashes_the_engine_and_drops_everything() -> None:
    crashes: list[str] = []
    config = SimConfig(step_time_s=0.001, vocab_size=100, max_running_requests=2)

    async def scenario(engine: SimEngine) -> None:
        engine.on_crash = crashes.append
        running = engine.submit("ok", [1], SamplingSpec(5000, ignore_eos=True), None)
        while running.produced < 2:
            await asyncio.sleep(0.001)
        bad = engine.submit("bad", [5, 100], SamplingSpec(5), None)
        await until_done(running, bad)
        assert (running.outcome, bad.outcome) == (Outcome.DROPPED, Outcome.DROPPED)
        assert engine.crashed is not None and "IndexError" in engine.crashed and "100" in engine.crashed

    run_with_engine(config, scenario)
    assert len(crashes) == 1


def test_without_the_crash_an_input_id_outside_the_vocabulary_is_a_400_abort() -> None:
    config = SimConfig(step_time_s=0.001, vocab_size=100, crash_on_bad_token_id=False)

    async def scenario(engine: SimEngine) -> None:
        bad = engine.submit("bad", [-1], SamplingSpec(5), None)
        good = engine.submit("good", [5], SamplingSpec(5), None)
        await until_done(bad, good)
        assert bad.finish_reason is not None
        assert (bad.finish_reason["status_code"], bad.finish_reason["err_type"]) == (400, "BadRequestError")
        assert good.outcome is Outcome.FINISHED
        assert engine.crashed is None

    run_with_engine(config, scenario)


def test_a_full_queue_and_a_prompt_over_max_req_input_len_end_as_aborts_with_status_codes() -> None:
    config = SimConfig(step_time_s=0.001, max_running_requests=1, max_queued_requests=1, max_total_tokens=20)

    async def scenario(engine: SimEngine) -> None:
        assert config.max_req_input_len == 14
        too_long = engine.submit("long", [5] * 14, SamplingSpec(1), None)
        assert too_long.finish_reason is not None and too_long.finish_reason["status_code"] == 400
        assert too_long.finish_reason["message"].startswith("Input length (14 tokens) exceeds")
        first = engine.submit("a", [1], SamplingSpec(5000, ignore_eos=True), None)
        while first.produced < 1:
            await asyncio.sleep(0.001)
        queued = engine.submit("b", [2], SamplingSpec(5), None)
        shed = engine.submit("c", [3], SamplingSpec(5), None)
        assert shed.finish_reason == {
            "type": "abort",
            "message": "The request queue is full.",
            "status_code": 503,
            "err_type": None,
        }
        assert not queued.done
        engine.abort(abort_all=True)

    run_with_engine(config, scenario)


def test_requests_waiting_or_running_too_long_are_shed_with_a_503() -> None:
    config = SimConfig(
        step_time_s=0.001, max_running_requests=1, req_waiting_timeout_s=0.02, req_running_timeout_s=0.05
    )

    async def scenario(engine: SimEngine) -> None:
        running = engine.submit("run", [1], SamplingSpec(5000, ignore_eos=True), None)
        waiting = engine.submit("wait", [2], SamplingSpec(5000, ignore_eos=True), None)
        await until_done(waiting)
        assert waiting.finish_reason is not None
        assert (waiting.finish_reason["message"], waiting.finish_reason["status_code"]) == (
            "Request waiting timeout reached.",
            503,
        )
        await until_done(running)
        assert running.finish_reason is not None
        assert running.finish_reason["message"] == "Request running timeout reached."
        assert 0 < running.produced < 5000

    run_with_engine(config, scenario)


def test_cancelling_a_request_stops_its_generation() -> None:
    async def scenario(engine: SimEngine) -> None:
        request = engine.submit("gone", [1], SamplingSpec(5000, ignore_eos=True), None)
        while request.produced < 5:
            await asyncio.sleep(0.001)
        engine.cancel(request)
        produced = request.produced
        await asyncio.sleep(0.02)
        stats = engine.stats()
        assert request.produced == produced
        assert stats["generated_tokens"] == produced
        assert (stats["aborted"], stats["disconnected"], stats["running"]) == (1, 1, 0)

    run_with_engine(FAST, scenario)


def test_faults_turn_away_cut_or_abort_requests() -> None:
    async def scenario(engine: SimEngine) -> None:
        engine.update_config({"error_rate": 1.0})
        with pytest.raises(OverloadedError):
            engine.submit("e", [1], SamplingSpec(20), None)
        engine.update_config({"error_rate": 0.0, "drop_rate": 1.0})
        dropped = engine.submit("d", [1], SamplingSpec(20), None)
        engine.update_config({"drop_rate": 0.0, "abort_rate": 1.0})
        aborted = engine.submit("a", [1], SamplingSpec(20), None)
        await until_done(dropped, aborted)
        assert dropped.outcome is Outcome.DROPPED and dropped.produced < 20
        assert aborted.outcome is Outcome.ABORTED and aborted.num_retractions == 1
        assert aborted.finish_reason is not None
        assert aborted.finish_reason["message"] == ABORT_MESSAGE_WAITING_QUEUE
        stats = engine.stats()
        assert (stats["errors_503"], stats["dropped"], stats["aborted"]) == (1, 1, 1)

    run_with_engine(FAST, scenario)


def test_stats_count_generated_tokens_by_rid_prefix_and_reset_to_zero() -> None:
    async def scenario(engine: SimEngine) -> None:
        requests = [
            engine.submit(f"{tag}{i:04d}", [i], SamplingSpec(10), None) for tag in "ab" for i in range(3)
        ]
        await until_done(*requests)
        by_tag = {tag: sum(len(r.output_ids()) for r in requests if r.rid[0] == tag) for tag in "ab"}
        assert engine.stats(prefix_len=1)["by_prefix"] == by_tag
        assert len(engine.stats()["by_prefix"]) == 6
        engine.reset_stats()
        assert engine.stats()["generated_tokens"] == 0
        assert engine.stats()["by_prefix"] == {}

    run_with_engine(FAST, scenario)


def test_a_request_continuing_one_cut_at_its_max_new_tokens_goes_on_with_the_same_plan() -> None:
    """A real model sent its prompt plus a partial answer goes on from the same context; so does the
    simulator: the continued pieces join into the answer one uncapped request gives."""
    prompt = [21, 22, 23, 24]
    config = dataclasses.replace(FAST, fixed_output_len=50)
    whole_plan = plan_output(prompt, SamplingSpec(max_new_tokens=500), config)

    async def scenario(engine: SimEngine) -> None:
        pieces: list[int] = []
        reasons = []
        for i, cap in enumerate((17, 20, 500)):
            request = engine.submit(f"r{i}", [*prompt, *pieces], SamplingSpec(max_new_tokens=cap), None)
            await until_done(request)
            pieces += request.output_ids()
            reasons.append(request.finish_reason)
        assert pieces == list(whole_plan.token_ids)
        assert [r["type"] for r in reasons] == ["length", "length", "stop"]
        assert reasons[1] == {"type": "length", "length": 20}  # the piece's own max_new_tokens
        # a prompt that merely looks like a continuation, but no request of it ended at its cap: its own plan
        other = engine.submit("r9", [*prompt, *pieces[:5]], SamplingSpec(max_new_tokens=500), None)
        await until_done(other)
        assert list(other.output_ids()) != list(whole_plan.token_ids[5:])

    run_with_engine(config, scenario)
