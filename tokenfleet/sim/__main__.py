"""``python -m tokenfleet.sim --port 30000 ...``"""

from tokenfleet.sim.server import main

raise SystemExit(main())
