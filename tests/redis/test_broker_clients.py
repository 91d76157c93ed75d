"""The broker's channels reuse one redis-py client each (``workers/broker_clients.py``), against a real
Redis: messages still go and come back, and a channel whose pool is replaced gets a new client."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis
from kombu import Consumer, Exchange, Producer, Queue
from kombu.transport import redis as kombu_redis

from workers.app import make_app
from workers.broker_clients import reuse_broker_clients

pytestmark = pytest.mark.redis


@pytest.fixture
def constructions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per ``redis.Redis`` built from here on."""
    built: list[int] = []
    original = redis.Redis.__init__

    def counting_init(self: redis.Redis, *args: Any, **kwargs: Any) -> None:
        built.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(redis.Redis, "__init__", counting_init)
    return built


def test_publishing_and_acking_a_hundred_messages_builds_one_redis_client_not_one_per_command(
    redis_client: redis.Redis, redis_url: str, constructions: list[int]
) -> None:
    app = make_app(redis_url)
    queue = Queue(f"q-{uuid.uuid4().hex[:8]}", Exchange("tf-test", type="direct"), routing_key="r")
    got: list[int] = []
    with app.connection_for_write() as conn:
        channel = conn.channel()
        producer = Producer(channel, exchange=queue.exchange, routing_key="r")
        queue(channel).declare()
        for i in range(100):
            producer.publish({"i": i}, serializer="json")
        built_publishing = len(constructions)

        def on_message(body: dict[str, int], message: Any) -> None:
            got.append(body["i"])
            message.ack()

        with Consumer(channel, queues=[queue], callbacks=[on_message], accept=["json"]):
            while len(got) < 100:
                conn.drain_events(timeout=5)
    assert got == list(range(100))  # each message once, in order
    # kombu alone builds a client per publish and per ack: 200 here
    assert built_publishing <= 2
    assert len(constructions) <= 4


def test_a_channel_whose_pool_is_replaced_takes_a_client_of_the_new_pool(
    redis_client: redis.Redis, redis_url: str
) -> None:
    app = make_app(redis_url)
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        with channel.conn_or_acquire() as first, channel.conn_or_acquire() as second:
            assert first is second
            assert first.ping()
        channel._pool = None  # what kombu does when the channel closes its connections to reconnect
        with channel.conn_or_acquire() as third:
            assert third is not first
            assert third.connection_pool is channel.pool
            assert third.ping()
        given = redis.Redis.from_url(redis_url)
        with channel.conn_or_acquire(given) as passed:  # a client passed in is used as it is
            assert passed is given
        given.close()


def test_a_channel_closing_after_its_connection_was_lost_raises_a_connection_error_the_close_ignores(
    redis_client: redis.Redis, redis_url: str
) -> None:
    app = make_app(redis_url)
    conn = app.connection_for_write()
    channel = conn.default_channel
    queue = Queue(f"q-{uuid.uuid4().hex[:8]}", Exchange("tf-test", type="direct"), routing_key="r")
    queue(channel).declare()
    Producer(channel, exchange=queue.exchange, routing_key="r").publish({"i": 1}, serializer="json")
    message = queue(channel).get(no_ack=False)  # delivered, not acknowledged
    assert message is not None
    # what a lost broker connection leaves (a Redis restart): no pool, and the transport without its client
    channel._pool = None
    client = channel.connection.client
    channel.connection.client = None
    with pytest.raises(redis.exceptions.ConnectionError), channel.conn_or_acquire():
        pass
    # kombu's close restores the unacknowledged message through it: a connection error, ignored there
    # (``kombu.common.ignore_errors``), where the AttributeError it raised before stopped the worker
    assert isinstance(redis.exceptions.ConnectionError(), tuple(channel.connection_errors))
    channel.connection.client = client
    conn.release()


def test_a_kombu_without_the_method_replaced_is_left_alone_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(kombu_redis.Channel, "conn_or_acquire")
    assert reuse_broker_clients() is False
    assert not hasattr(kombu_redis.Channel, "conn_or_acquire")
