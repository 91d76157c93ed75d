"""Where the tests find Redis, and the settings of the fleet's test workers.

Redis is the one on ``TOKENFLEET_TEST_REDIS_URL`` (default db 15 of 127.0.0.1:6379); the fleet uses its own
database (``TOKENFLEET_TEST_FLEET_REDIS_URL``, default db 14). When none answers the tests that need it are
skipped locally but fail in CI (``CI=true``), where ``.ci/run`` starts one.
"""

from __future__ import annotations

import os

TEST_REDIS_URL = os.environ.get("TOKENFLEET_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
FLEET_REDIS_URL = os.environ.get("TOKENFLEET_TEST_FLEET_REDIS_URL", "redis://127.0.0.1:6379/14")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

#: Short leases so a killed worker's samples come back within seconds in tests.
WORKER_ENV = {"TOKENFLEET_LEASE_S": "3", "TOKENFLEET_VISIBILITY_TIMEOUT_S": "60"}
WORKER_PROCESSES = 2
WORKER_CONCURRENCY = 8
#: How long a test waits for the fleet to reach a state.
WAIT_S = 60
