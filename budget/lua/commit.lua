-- commit: a generation's record is written and flushed; count it, exactly once.
-- KEYS: ledger, done, leases, owners, live, pending, rate_tokens, rate_samples
-- ARGV: sid, attempt, completion_tokens, truncated (0 | 1)
-- Returns {outcome, state}: committed | duplicate (already committed by another attempt) |
-- over_limit (max_samples already reached: not counted, so not exported) | revoked (the operator stopped
-- the dataset: nothing more of it is counted or exported; the sample is pending) | unknown (forgotten).
local sid, attempt, n, truncated = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
if not known(ledger) then return {'unknown', 'unknown'} end
local mine = owns(owners, sid, attempt)
if mine then
  -- the tokens of the last chunk(s) never went through progress: they count as generated now
  rate_add(rate_tokens, n - drop_lease(ledger, leases, owners, live, sid))
end
local outcome = 'committed'
local max = limit(ledger, 'max_samples')
if redis.call('HEXISTS', done, sid) == 1 then
  outcome = 'duplicate'
elseif redis.call('HGET', ledger, 'state') == 'revoked' then
  outcome = 'revoked'
  redis.call('HSET', pending, sid, 'revoked')
elseif max and num(ledger, 'samples') >= max then
  outcome = 'over_limit'
end
if outcome ~= 'committed' then
  redis.call('HINCRBY', ledger, 'wasted_tokens', n)
  return {outcome, redis.call('HGET', ledger, 'state') or 'unknown'}
end
redis.call('HSET', done, sid, attempt)
redis.call('HDEL', pending, sid)
redis.call('HINCRBY', ledger, 'tokens', n)
redis.call('HINCRBY', ledger, 'samples', 1)
if truncated == '1' then redis.call('HINCRBY', ledger, 'truncated', 1) end
rate_add(rate_samples, 1)
return {outcome, refresh_state(ledger)}
