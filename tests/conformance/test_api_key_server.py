"""The fleet against a real SGLang server that wants a key: ``--api-key`` for generation and
``--admin-api-key`` for ``/abort_request``. Workers and submit read the keys from their own environment;
nothing the fleet writes (logs, status, Redis, records) holds them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from budget import Ledger
from tests.conformance.helpers import (
    ADMIN_KEY_ENV,
    API_KEY_ENV,
    ServerKeys,
    Submit,
    Workers,
    export_records,
    mismatches_with_server,
    run_cli,
    token_rows,
    wait_for,
    write_fleet_config,
)
from tests.conformance.real_server import RealServer
from workers.rids import dataset_tag

pytestmark = [pytest.mark.conformance, pytest.mark.timeout(300)]


def redis_contents(url: str) -> bytes:
    """Every key and value of the fleet's Redis database, as bytes to search."""
    client = redis.Redis.from_url(url)
    parts: list[bytes | str] = []
    try:
        for key in client.scan_iter(count=1000):
            kind = client.type(key)
            parts.append(key)
            if kind == b"string":
                parts.append(client.get(key) or b"")
            elif kind == b"hash":
                parts += [b for kv in client.hgetall(key).items() for b in kv]
            elif kind == b"list":
                parts += client.lrange(key, 0, -1)
            elif kind == b"set":
                parts += list(client.smembers(key))
            elif kind == b"zset":
                parts += [m if isinstance(m, (bytes, str)) else repr(m) for m in client.zrange(key, 0, -1)]
            elif kind == b"stream":
                parts += [repr(entry) for entry in client.xrange(key) or []]
    finally:
        client.close()
    return b"\n".join(p if isinstance(p, bytes) else p.encode() for p in parts)


def files_under(*folders: Path) -> bytes:
    return b"\n".join(p.read_bytes() for folder in folders for p in sorted(folder.rglob("*")) if p.is_file())


def test_a_keyed_server_is_used_end_to_end_and_the_keys_appear_nowhere_the_fleet_writes(
    conformance_workers: Workers,
    fleet_redis_url: str,
    fleet_ledger: Ledger,
    keyed_server: RealServer,
    server_keys: ServerKeys,
    dataset_name: Any,
    tmp_path: Path,
) -> None:
    unauthorized = httpx.post(
        f"{keyed_server.url}/generate",
        json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}},
        timeout=30,
    )
    assert unauthorized.status_code == 401  # the server really wants the key
    full, revoked = dataset_name("keyed_full"), dataset_name("keyed_revoked")
    rows = token_rows(40, seed=11)
    config = write_fleet_config(
        tmp_path,
        redis_url=fleet_redis_url,
        server=keyed_server.url,
        server_options={"api_key_env": API_KEY_ENV, "admin_api_key_env": ADMIN_KEY_ENV},
        datasets=[
            {"name": full, "rows": rows},
            # Revoked while its requests run: the fleet aborts them by rid with the admin key.
            {
                "name": revoked,
                "rows": token_rows(200, seed=12),
                "sampling": {"max_new_tokens": 512, "ignore_eos": True},
            },
        ],
        sampling={"max_new_tokens": 64},
    )
    keys = {API_KEY_ENV: server_keys.api_key, ADMIN_KEY_ENV: server_keys.admin_api_key}

    run = Submit(config, "--window", "64", env=keys)
    wait_for(
        lambda: (
            revoked in fleet_ledger.datasets()
            and fleet_ledger.snapshot(revoked).samples >= 1
            and fleet_ledger.snapshot(revoked).inflight > 0
        ),
        120,
        "a sample of the dataset to revoke done and others running",
    )
    assert run_cli("revoke", revoked, "--redis-url", fleet_redis_url).returncode == 0
    assert run.wait() == 0, run.output()[-2000:]

    records = export_records(fleet_ledger, full, tmp_path)
    assert len(records) == len(rows)
    sources = {r["id"]: r["input_ids"] for r in rows}
    assert mismatches_with_server(records, keyed_server.requests(dataset_tag(full)), sources) == []
    assert fleet_ledger.snapshot(revoked).state == "revoked"
    aborted = [
        r
        for r in keyed_server.requests(dataset_tag(revoked)).values()
        if (r.finish_reason or {}).get("message") == "Aborted"
    ]
    assert aborted, "no request of the revoked dataset was aborted by /abort_request (the admin key)"
    plain = run_cli("status", "--redis-url", fleet_redis_url)
    as_json = run_cli("status", "--json", "--redis-url", fleet_redis_url)
    assert plain.returncode == 0 and as_json.returncode == 0
    written = {
        "worker logs": files_under(conformance_workers.logs),
        "submit's output": run.output().encode(),
        "status": plain.stdout.encode() + plain.stderr.encode(),
        "status --json": as_json.stdout.encode(),
        "Redis": redis_contents(fleet_redis_url),
        "records and exports": files_under(tmp_path / "out", tmp_path / "exports"),
    }
    for key in (server_keys.api_key, server_keys.admin_api_key):
        assert [where for where, content in written.items() if key.encode() in content] == []
