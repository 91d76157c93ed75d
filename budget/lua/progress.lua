-- progress: an in-flight generation reports new tokens; the answer says whether to go on.
-- KEYS: ledger, leases, owners, live, rate_tokens
-- ARGV: sid, attempt, new_tokens, lease_ms
-- Returns {action, state}: action is
--   continue  keep generating (the lease is renewed)
--   stop      the budget is reached (policy truncate or discard), or the dataset was revoked or paused
--   lost      this attempt no longer holds the lease (it expired and was reclaimed)
local sid, attempt, n, lease_ms = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local state = redis.call('HGET', ledger, 'state') or 'unknown'
if not owns(owners, sid, attempt) then return {'lost', state} end
if n ~= 0 then
  redis.call('HINCRBY', live, sid, n)
  redis.call('HINCRBY', ledger, 'live_tokens', n)
end
rate_add(rate_tokens, n)
redis.call('ZADD', leases, 'XX', now_ms() + lease_ms, sid)
if state == 'revoked' or state == 'paused' then return {'stop', state} end
local budget = limit(ledger, 'token_budget')
if budget and redis.call('HGET', ledger, 'on_budget') ~= 'drain'
    and spent(ledger) + num(ledger, 'live_tokens') >= budget then
  return {'stop', state}
end
return {'continue', state}
