-- set_limits: change a dataset's limits live (tokenfleet budget).
-- KEYS: ledger
-- ARGV: token_budget ("" = none, "-" = unchanged), max_samples (same)
-- Returns the new state, or "unknown".
if not redis.call('HGET', ledger, 'state') then return 'unknown' end
if ARGV[1] ~= '-' then redis.call('HSET', ledger, 'token_budget', ARGV[1]) end
if ARGV[2] ~= '-' then redis.call('HSET', ledger, 'max_samples', ARGV[2]) end
return refresh_state(ledger)
