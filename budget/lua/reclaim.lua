-- reclaim: take back expired leases (workers that died mid-generation).
-- KEYS: ledger, leases, owners, live, pending, done, failed
-- ARGV: (none)
-- Returns how many leases were reclaimed.
return reclaim_expired(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], now_ms())
