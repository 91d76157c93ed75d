"""``workers.sglang.protocol``'s table of sampling_params keys and types, checked without a server."""

from __future__ import annotations

from typing import Any

import pytest

from workers.sglang.protocol import (
    SAMPLING_PARAM_KEYS,
    SAMPLING_PARAM_TYPES,
    sampling_param_errors,
    sampling_param_server_error,
    unknown_sampling_key_error,
)


def test_the_table_holds_the_28_keys_of_sglang_0_5_23_in_its_order() -> None:
    keys = list(SAMPLING_PARAM_TYPES)
    assert len(keys) == len(SAMPLING_PARAM_KEYS) == 28
    assert keys[:3] == ["max_new_tokens", "stop", "stop_token_ids"]
    assert keys[-3:] == ["beam_width", "watermark", "choice"]
    assert unknown_sampling_key_error("max_tokens").startswith(
        "unknown field `max_tokens`, expected one of `max_new_tokens`, `stop`, `stop_token_ids`, "
    )


def test_accepted_params_have_no_errors() -> None:
    params: dict[str, Any] = {
        "max_new_tokens": 100,
        "stop": ["a", "b"],
        "stop_token_ids": [2],
        "stop_regex": "x+",
        "temperature": 0,  # an int where a float goes
        "top_p": 0.9,
        "top_k": None,  # null means the default
        "ignore_eos": True,
        "logit_bias": {"5": -1, "6": 0.5},
        "custom_params": {"anything": [1]},
        "beam_width": 2,
        "watermark": {"enabled": True, "key": "k", "context_window": 4},
        "choice": ["yes", "no"],
    }
    assert sampling_param_errors(params) == []
    assert sampling_param_server_error(params) is None


@pytest.mark.parametrize(
    ("params", "problem"),
    [
        ({"max_new_tokens": 100.0}, "sampling_params `max_new_tokens` must be an integer"),
        ({"max_new_tokens": True}, "sampling_params `max_new_tokens` must be an integer"),
        ({"temperature": "0.7"}, "sampling_params `temperature` must be a number"),
        ({"temperature": False}, "sampling_params `temperature` must be a number"),
        ({"regex": 5}, "sampling_params `regex` must be a string"),
        ({"ignore_eos": 1}, "sampling_params `ignore_eos` must be true or false"),
        ({"stop": ["a", 1]}, "sampling_params `stop` must be a string or a list of strings"),
        ({"stop_token_ids": [1.5]}, "sampling_params `stop_token_ids` must be a list of integers"),
        ({"logit_bias": {"5": "x"}}, "sampling_params `logit_bias` must be a map of numbers"),
        ({"choice": "yes"}, "sampling_params `choice` must be a list of strings"),
        ({"watermark": {"color": 1}}, "sampling_params `watermark` must be a watermark object"),
        ({"max_tokens": 5}, "unknown sampling_params key `max_tokens`"),
    ],
)
def test_each_wrong_type_or_unknown_key_is_one_readable_problem(params: dict[str, Any], problem: str) -> None:
    problems = sampling_param_errors(params)
    assert len(problems) == 1
    assert problems[0].startswith(problem)
    assert sampling_param_server_error(params) is not None


def test_every_problem_is_listed_while_the_server_names_the_first() -> None:
    params = {"max_tokens": 5, "max_new_tokens": 1.0}
    assert len(sampling_param_errors(params)) == 2
    assert sampling_param_server_error(params) == unknown_sampling_key_error("max_tokens")
    assert sampling_param_server_error({"max_new_tokens": 1.0}) == (
        "invalid type: floating point `1.0`, expected i64"
    )
