-- set_limits: change a dataset's limits live (tokenfleet budget).
-- KEYS: ledger
-- ARGV: token_budget ("" = none, "-" = unchanged), max_samples (same)
-- Returns the new state, or "unknown". A limit changed here is marked <limit>_set_live, so that submit
-- run again with an unchanged config keeps it instead of undoing it (register.lua).
if not redis.call('HGET', ledger, 'state') then return 'unknown' end
if ARGV[1] ~= '-' then redis.call('HSET', ledger, 'token_budget', ARGV[1], 'token_budget_set_live', 1) end
if ARGV[2] ~= '-' then redis.call('HSET', ledger, 'max_samples', ARGV[2], 'max_samples_set_live', 1) end
return refresh_state(ledger)
