"""Where the ledger lives (the one setting every process needs), and URLs as they may be shown."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Final

#: The Redis URL used when neither the environment nor a config names one.
DEFAULT_REDIS_URL: Final = "redis://127.0.0.1:6379/0"

#: Environment variable that overrides the Redis URL everywhere (config file, workers, CLI).
REDIS_URL_ENV: Final = "TOKENFLEET_REDIS_URL"


def redis_url_from_env(env: Mapping[str, str] | None = None, default: str = DEFAULT_REDIS_URL) -> str:
    env = os.environ if env is None else env
    return env.get(REDIS_URL_ENV) or default


_SECRET_QUERY_RE: Final = re.compile(
    r"([?&;](?:password|passwd|pass|pwd|secret|token|access_token|auth)=)[^&;#]*", re.IGNORECASE
)


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***``: ``redis://user:***@host:6379/0``.

    Also masks ``password=``-style query parameters (redis-py honours ``?password=``). Never raises;
    when in doubt it masks more rather than less. Use it for every URL that reaches a log or a status.
    """
    sep = url.find("://")
    if sep < 0:
        return _SECRET_QUERY_RE.sub(r"\1***", url)
    start = sep + 3
    # rfind: a password may itself hold "@" or "/"; masking a little too much beats leaking.
    at = url.rfind("@", start)
    if at >= 0:
        userinfo = url[start:at]
        user, colon, _password = userinfo.partition(":")
        if colon:
            url = f"{url[:start]}{user}:***{url[at:]}"
    return _SECRET_QUERY_RE.sub(r"\1***", url)
