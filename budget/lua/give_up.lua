-- give_up: an attempt's retries ran out on retryable errors (5xx, dropped streams, timeouts). The sample
-- becomes pending, to be fed again once the dataset is quiet; after max_strikes such give-ups it fails
-- for good with the reason (a prompt that keeps breaking the server must not be fed forever).
-- KEYS: ledger, done, leases, owners, live, reserved, clock, pending, failed, strikes
-- ARGV: sid, attempt, reason, wasted_tokens, max_strikes
-- Returns "pending", "failed", "duplicate" (already committed) or "unknown" (forgotten dataset).
local sid, attempt, reason = ARGV[1], ARGV[2], ARGV[3]
if not known(ledger) then return 'unknown' end
if owns(owners, sid, attempt) then drop_lease(ledger, leases, owners, live, reserved, clock, sid) end
redis.call('HINCRBY', ledger, 'wasted_tokens', tonumber(ARGV[4]))
if redis.call('HEXISTS', done, sid) == 1 then return 'duplicate' end
if redis.call('HEXISTS', failed, sid) == 1 then  -- another attempt's give-up already failed it for good
  redis.call('HDEL', pending, sid)
  return 'failed'
end
if redis.call('HINCRBY', strikes, sid, 1) >= tonumber(ARGV[5]) then
  redis.call('HDEL', strikes, sid)
  redis.call('HDEL', pending, sid)
  redis.call('HSET', failed, sid, reason)
  return 'failed'
end
redis.call('HSET', pending, sid, 'server_unavailable')
return 'pending'
