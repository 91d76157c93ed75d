"""One redis-py client per broker channel, not one per command.

kombu's Redis channel (5.7) builds a new ``redis.Redis`` in ``Channel.conn_or_acquire`` for every command
it sends outside its event loop: each publish, each ack, each task event. With redis-py 8 a client costs
100-250 µs to build (it fills its table of response callbacks), and a worker on short answers built
2,650 a second for 6,000 samples: 5% of its CPU. A client holds no connection of its own (it takes one
from the pool for each command) and may be shared by threads, so one per channel and pool does the same
work. A channel that reconnects gets a new pool, and with it a new client.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis.exceptions
from kombu.transport import redis as kombu_redis

_CACHED: str = "_tokenfleet_client"


@contextmanager
def _conn_or_acquire(self: Any, client: Any = None) -> Iterator[Any]:
    if client:
        yield client
        return
    if self.__dict__.get("_pool") is None and self.connection.client is None:
        # A channel closing after its broker connection was lost (a Redis restart): kombu (5.7) drops the
        # pool, then restores the unacknowledged messages, and building a pool without the connection's
        # parameters raised AttributeError, which Celery took for an "Unrecoverable error": the worker
        # stopped consuming for good. As a connection error it is ignored by the close, the consumer
        # reconnects, and the messages stay in the broker's unacked set, restored by restore_visible.
        raise redis.exceptions.ConnectionError("the broker connection is closed")
    pool = self.pool
    cached = self.__dict__.get(_CACHED)
    if cached is None or cached.connection_pool is not pool:
        cached = self._create_client()  # kombu's own, with its options (credentials, key prefix)
        setattr(self, _CACHED, cached)
    yield cached


def reuse_broker_clients() -> bool:
    """Install the per-channel client on kombu's Redis channel (once; every app in the process shares
    it). False, and nothing changed, when kombu no longer has the method this replaces."""
    channel = kombu_redis.Channel
    current = getattr(channel, "conn_or_acquire", None)
    if current is _conn_or_acquire:
        return True
    if not callable(current) or not callable(getattr(channel, "_create_client", None)):
        return False
    channel.conn_or_acquire = _conn_or_acquire  # type: ignore[method-assign]
    return True
