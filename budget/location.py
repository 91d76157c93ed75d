"""Where the ledger lives: the one setting every process needs."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Final

#: The Redis URL used when neither the environment nor a config names one.
DEFAULT_REDIS_URL: Final = "redis://127.0.0.1:6379/0"

#: Environment variable that overrides the Redis URL everywhere (config file, workers, CLI).
REDIS_URL_ENV: Final = "TOKENFLEET_REDIS_URL"


def redis_url_from_env(env: Mapping[str, str] | None = None, default: str = DEFAULT_REDIS_URL) -> str:
    env = os.environ if env is None else env
    return env.get(REDIS_URL_ENV) or default
