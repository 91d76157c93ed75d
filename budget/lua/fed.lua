-- fed: a producer (tokenfleet submit) feeding a dataset says so, about once a second, so that status can
-- tell a dataset with samples left to feed and nothing feeding it (submit stopped, or never run again
-- after a resume) from one being fed.
-- KEYS: ledger
-- ARGV: (none)
-- Returns 1, or 0 where the dataset is unknown (a lost ledger is not brought back by it).
if not redis.call('HGET', ledger, 'state') then return 0 end
redis.call('HSET', ledger, 'fed_at_ms', now_ms())
return 1
