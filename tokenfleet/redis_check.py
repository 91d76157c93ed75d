"""Whether the credentials in a ``redis_url`` protect anything.

redis-py sends the URL's password with ``AUTH``; a Redis with no password configured answers it without a
word, and the user believes the ledger is protected while anyone who reaches the port may change or erase
it. ``unprotected_warning`` asks the same Redis without credentials: when it takes commands so, the
password protects nothing, and submit and status say so.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis

from budget.keys import DATASETS_SET
from budget.urls import redact_url

#: Query parameters redis-py reads credentials from.
_CREDENTIAL_PARAMS = ("username", "password")
#: How long the check waits for Redis (it has answered the real client a moment before).
CHECK_TIMEOUT_S = 5.0


def without_credentials(url: str) -> str:
    """``url`` with its user and password left out (host, port, database and query kept)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k not in _CREDENTIAL_PARAMS])
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _has_password(url: str) -> bool:
    parts = urlsplit(url)
    return bool(parts.password) or any(k == "password" and v for k, v in parse_qsl(parts.query))


def unprotected_warning(url: str) -> str | None:
    """A warning when ``url`` carries a password and its Redis takes commands without one; else None
    (no password in the URL, Redis refuses an unauthenticated client, or the check cannot tell)."""
    try:
        if not _has_password(url) or urlsplit(url).scheme == "unix":
            return None
    except ValueError:
        return None
    client = redis.Redis.from_url(
        without_credentials(url), socket_connect_timeout=CHECK_TIMEOUT_S, socket_timeout=CHECK_TIMEOUT_S
    )
    try:
        client.exists(DATASETS_SET)  # a read of the ledger, as anyone on the network could do
    except redis.RedisError:  # NOAUTH, NOPERM (an ACL default user without rights), unreachable
        return None
    finally:
        client.close()
    return (
        f"the redis_url {redact_url(url)} has a password, but that Redis has none: it takes commands "
        "without one, so the password protects nothing (anyone who reaches the port can read, change or "
        "erase the ledger); set requirepass (or an ACL user) on that Redis, or drop the password from "
        "the URL"
    )
