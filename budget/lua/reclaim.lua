-- reclaim: take back expired leases (workers that died mid-generation).
-- KEYS: ledger, leases, owners, live, reserved, clock, pending, done, failed
-- ARGV: (none)
-- Returns how many leases were reclaimed.
return reclaim_expired(ledger, leases, owners, live, reserved, clock, pending, done, failed, now_ms())
