"""The user's TOML config, validated with pydantic v2.

The package: the models (``models``), loading (``loading``), the one error a user sees (``errors``), its
wording (``wording``) and the line scanner behind it (``toml_lines``).

Every table forbids unknown keys, so a typo is an error rather than a silently ignored setting. Every
problem surfaces as one `ConfigError` line naming the file and, when it can be found, the line::

    config.toml:14: dataset "x": unknown sampling_params key "max_tokens" (SGLang 0.5 rejects it on
    every request; did you mean "max_new_tokens"?)

Example::

    redis_url = "redis://127.0.0.1:6379/0"   # env TOKENFLEET_REDIS_URL overrides it
    output_dir = "out"                        # relative paths resolve against this file's folder

    [server]
    urls = ["http://127.0.0.1:30000"]
    timeout_s = 1800

    [sampling]                                # sent as sampling_params
    max_new_tokens = 4096
    temperature = 0.7

    [[dataset]]
    name = "B2_opencodeinstruct"
    path = "data/b2.jsonl"
    token_budget = 10_000_000                 # completion tokens; absent = no budget
    max_samples = 7000                        # absent = no cap
    on_budget = "truncate"                    # "truncate" | "discard" | "drain"
    [dataset.sampling]                        # overrides [sampling] for this dataset
    temperature = 0.2
"""

from __future__ import annotations

from budget.urls import DEFAULT_REDIS_URL, REDIS_URL_ENV, redact_url
from tokenfleet.config.errors import ConfigError
from tokenfleet.config.loading import load_config
from tokenfleet.config.models import (
    DATASET_NAME_MAX_LEN,
    DEFAULT_OUTPUT_DIR,
    DEFAULT_STALL_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    DatasetConfig,
    FleetConfig,
    FsyncPolicy,
    OnBudget,
    RetryConfig,
    ServerConfig,
    ServerKeys,
)

__all__ = [
    "DATASET_NAME_MAX_LEN",
    "DEFAULT_OUTPUT_DIR",
    "DEFAULT_REDIS_URL",
    "DEFAULT_STALL_TIMEOUT_S",
    "DEFAULT_TIMEOUT_S",
    "REDIS_URL_ENV",
    "ConfigError",
    "DatasetConfig",
    "FleetConfig",
    "FsyncPolicy",
    "OnBudget",
    "RetryConfig",
    "ServerConfig",
    "ServerKeys",
    "load_config",
    "redact_url",
]
