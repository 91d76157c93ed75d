-- admit: a worker took a task from the queue and asks whether to generate it.
-- KEYS: ledger, spec, done, queued, leases, owners, live, pending, failed
-- ARGV: sid, attempt, lease_ms
-- Returns {verdict, state, spec_json}. verdict:
--   ok        generate; the caller holds the sample's lease until commit, fail or release
--   done      already committed (a second delivery); nothing to do
--   failed    already failed for good (a second delivery); nothing to do
--   leased    another attempt holds the lease right now (a duplicate delivery); nothing to do
--   paused | revoked | exhausted | limit    dropped without generation; the sample is pending again
--   unknown   the dataset is not in this ledger
local sid, attempt, lease_ms = ARGV[1], ARGV[2], tonumber(ARGV[3])
local now = now_ms()
redis.call('ZREM', queued, sid)
local state = redis.call('HGET', ledger, 'state')
if not state then return {'unknown', '', ''} end
reclaim_expired(ledger, leases, owners, live, pending, done, failed, now)
if redis.call('HEXISTS', done, sid) == 1 then return {'done', state, ''} end
if redis.call('HEXISTS', failed, sid) == 1 then return {'failed', state, ''} end
if redis.call('ZSCORE', leases, sid) then return {'leased', state, ''} end
local verdict = 'ok'
if state ~= 'active' then
  verdict = state
else
  local max = limit(ledger, 'max_samples')
  if budget_blocked(ledger, leases) then
    verdict = 'limit'
  elseif max and num(ledger, 'samples') + redis.call('ZCARD', leases) >= max then
    verdict = 'limit'
  end
end
if verdict ~= 'ok' then
  redis.call('HSET', pending, sid, verdict)
  return {verdict, state, ''}
end
redis.call('HDEL', pending, sid)
redis.call('ZADD', leases, now + lease_ms, sid)
redis.call('HSET', owners, sid, attempt)
redis.call('HSET', live, sid, 0)
return {'ok', state, redis.call('GET', spec) or ''}
