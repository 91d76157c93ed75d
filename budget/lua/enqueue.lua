-- enqueue: the producer asks which samples to publish, within the dataset's queue window.
-- KEYS: ledger, done, failed, queued, leases, pending
-- ARGV: window, sid1, sid2, ...
-- Returns one code per sid, in order, possibly fewer than asked:
--   1 = publish it (now in the queued set), 0 = skip it (done, failed, queued or in flight);
-- the list ends early with -1 when the window (or the sample cap) is full, and is {-2} when the
-- dataset is not active and {-3} when its token budget is taken by committed, live and expected tokens
-- (see budget_blocked in _lib.lua).
if redis.call('HGET', ledger, 'state') ~= 'active' then return {-2} end
if budget_blocked(ledger, leases) then return {-3} end
local room = tonumber(ARGV[1]) - redis.call('ZCARD', queued)
local max = limit(ledger, 'max_samples')
if max then
  local cap = max - num(ledger, 'samples') - redis.call('ZCARD', leases) - redis.call('ZCARD', queued)
  if cap < room then room = cap end
end
local now = now_ms()
local out = {}
for i = 2, #ARGV do
  local sid = ARGV[i]
  if redis.call('HEXISTS', done, sid) == 1 or redis.call('HEXISTS', failed, sid) == 1
      or redis.call('ZSCORE', queued, sid) or redis.call('ZSCORE', leases, sid) then
    out[#out + 1] = 0
  elseif room <= 0 then
    out[#out + 1] = -1
    return out
  else
    redis.call('ZADD', queued, now, sid)
    redis.call('HDEL', pending, sid)
    room = room - 1
    out[#out + 1] = 1
  end
end
return out
