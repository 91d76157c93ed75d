-- enqueue: the producer asks which samples to publish, within the dataset's queue window. One call for
-- a whole batch: its cost in Redis commands does not grow with the batch's size.
-- KEYS: ledger, done, failed, queued, leases, pending
-- ARGV: window, sid1, sid2, ...
-- Returns one code per sid, in order, possibly fewer than asked:
--   1 = publish it (now in the queued set), 0 = skip it (done, failed, queued or in flight);
-- the list ends early with -1 when the window (or the sample cap, or the token budget) is full, and is
-- {-2} when the dataset is not active and {-3} when no generation may start for its token budget (see
-- budget_room in _lib.lua).
if redis.call('HGET', ledger, 'state') ~= 'active' then return {-2} end
local room = tonumber(ARGV[1]) - redis.call('ZCARD', queued)
local max = limit(ledger, 'max_samples')
if max then
  local cap = max - num(ledger, 'samples') - redis.call('ZCARD', leases) - redis.call('ZCARD', queued)
  if cap < room then room = cap end
end
local budget_cap = budget_room(ledger, leases, queued, math.max(room, 1))
if budget_cap <= 0 then return {-3} end
if budget_cap < room then room = budget_cap end
local out = {}
if #ARGV < 2 then return out end
local sids = {}
for i = 2, #ARGV do sids[#sids + 1] = ARGV[i] end
local is_done = redis.call('HMGET', done, unpack(sids))
local is_failed = redis.call('HMGET', failed, unpack(sids))
local is_queued = redis.call('ZMSCORE', queued, unpack(sids))
local is_leased = redis.call('ZMSCORE', leases, unpack(sids))
local now = now_ms()
local add, published, seen = {}, {}, {}
for i, sid in ipairs(sids) do
  if is_done[i] or is_failed[i] or is_queued[i] or is_leased[i] or seen[sid] then
    out[#out + 1] = 0
  elseif room <= 0 then
    out[#out + 1] = -1
    break
  else
    seen[sid] = true
    add[#add + 1] = now
    add[#add + 1] = sid
    published[#published + 1] = sid
    room = room - 1
    out[#out + 1] = 1
  end
end
if #published > 0 then
  redis.call('ZADD', queued, unpack(add))
  redis.call('HDEL', pending, unpack(published))
end
return out
