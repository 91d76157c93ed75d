-- fail: a sample cannot be generated (the server rejected it, or retries ran out); record why.
-- KEYS: ledger, done, failed, leases, owners, live, reserved, clock, pending
-- ARGV: sid, attempt, reason, wasted_tokens
-- Returns "failed", "duplicate" when another attempt already committed it, or "unknown".
local sid, attempt = ARGV[1], ARGV[2]
if not known(ledger) then return 'unknown' end
if owns(owners, sid, attempt) then drop_lease(ledger, leases, owners, live, reserved, clock, sid) end
redis.call('HINCRBY', ledger, 'wasted_tokens', tonumber(ARGV[4]))
if redis.call('HEXISTS', done, sid) == 1 then return 'duplicate' end
redis.call('HSET', failed, sid, ARGV[3])
redis.call('HDEL', pending, sid)
return 'failed'
