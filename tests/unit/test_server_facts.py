"""What submit reads from a server's answers: the batch size in force, the prompt limit, the vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

from tokenfleet.server_facts import batch_size_of, smallest, vocab_size_of

# /server_info of a real sglang 0.5.23 launched without --max-running-requests (shape observed).
REAL_INFO = {
    "max_running_requests": None,
    "context_length": None,
    "max_req_input_len": 2042,
    "internal_states": [{"effective_max_running_requests_per_dp": 32, "last_gen_throughput": 0.0}],
}


def test_the_batch_size_is_the_effective_one_when_max_running_requests_is_null() -> None:
    assert batch_size_of(REAL_INFO) == 32


def test_the_batch_size_sums_the_data_parallel_ranks() -> None:
    info = {
        "max_running_requests": 48,
        "internal_states": [
            {"effective_max_running_requests_per_dp": 48},
            {"effective_max_running_requests_per_dp": 40},
        ],
    }
    assert batch_size_of(info) == 88


def test_the_launch_argument_is_the_batch_size_only_when_no_rank_reports_one() -> None:
    assert batch_size_of({"max_running_requests": 7, "internal_states": [{}]}) == 7
    assert batch_size_of({"internal_states": [{"max_running_requests": 5}]}) == 5
    assert batch_size_of({"max_running_requests": None}) is None
    assert batch_size_of({"internal_states": [{"effective_max_running_requests_per_dp": True}]}) is None


def test_the_vocabulary_comes_from_the_config_json_of_the_model_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 2048}))
    assert vocab_size_of({"model_path": str(tmp_path), "tokenizer_path": str(tmp_path)}) == 2048


def test_a_multimodal_config_gives_its_text_models_vocabulary(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 151_936}}))
    assert vocab_size_of({"model_path": str(tmp_path)}) == 151_936


def test_the_tokenizer_folder_is_read_when_the_model_folder_is_not_here(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 100}))
    assert vocab_size_of({"model_path": "/not/here", "tokenizer_path": str(tmp_path)}) == 100


def test_an_unreadable_or_remote_model_folder_gives_no_vocabulary(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("not json")
    assert vocab_size_of({"model_path": str(tmp_path)}) is None
    assert vocab_size_of({"model_path": "meta-llama/Llama-3.1-8B-Instruct"}) is None
    assert vocab_size_of({}) is None


def test_smallest_ignores_what_no_server_told() -> None:
    assert smallest([None, 4096, 2048]) == 2048
    assert smallest([None, None]) is None


def test_a_dataset_spec_survives_the_ledger_round_trip_and_fills_what_an_older_submit_left_out() -> None:
    from budget.spec import DatasetSpec

    spec = DatasetSpec(
        servers=("http://a:1",),
        output_dir="/out",
        sampling={"max_new_tokens": 16},
        max_inflight_per_server={"http://a:1": 32},
        auth={"http://a:1": {"api_key": {"env": "K"}}},
        vocab_size=2048,
    )
    assert DatasetSpec.from_json(json.loads(json.dumps(spec.as_json()))) == spec
    assert "stream_interval" not in spec.sampling  # a worker paces each request itself
    older = DatasetSpec.from_json({"servers": ["http://a:1"], "output_dir": "/out", "max_new_tokens": 9})
    assert older.timeout_s == 1800.0 and older.max_attempts == 5 and older.on_budget == "truncate"
    assert older.vocab_size is None and older.auth_of("http://a:1") is None
