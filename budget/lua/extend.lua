-- extend: generations whose streams near their grants ask for more of the budget (truncate, discard). One
-- call covers a worker process's asks of one dataset that came together: its cost in Redis commands does
-- not grow with their number.
-- KEYS: ledger, leases, owners, reserved, queued
-- ARGV: for each ask: sid, attempt, more (the most tokens more its generation may still produce), least
--       (the fewest worth granting: its stream stops this far before its grant, so less would not keep it
--       going; 0: any)
-- Returns, per ask, the generation's grant after the call (its tokens of the budget in all): the same as
-- before when the budget has none to give now, and 0 when this attempt no longer holds the lease (it was
-- taken back: its generation must stop). A dataset without grants (no token budget, or drain) gives
-- nothing: its generations never ask. Grants are sized as admit sizes them (grant_size in _lib.lua): at most
-- a share of what is unreserved per generation in flight, so the last of the budget goes to many.
local STRIDE = 4
local n = #ARGV / STRIDE
local sids = {}
for i = 1, n do sids[i] = ARGV[STRIDE * (i - 1) + 1] end
local f = redis.call('HMGET', ledger, 'state', 'token_budget', 'on_budget', 'tokens', 'discarded_tokens',
  'reserved_tokens', 'samples', 'starved')
local owner = redis.call('HMGET', owners, unpack(sids))
local held = redis.call('HMGET', reserved, unpack(sids))
local budget, mode = tonumber(f[2] or ''), f[3]
local give = f[1] == 'active' or f[1] == 'exhausted'
local left, inflight, mean = 0, 0, 0
if budget and mode ~= 'drain' then
  left = grant_pool(mode, budget) - (tonumber(f[4]) or 0) - (tonumber(f[5]) or 0) - (tonumber(f[6]) or 0)
  inflight = redis.call('ZCARD', leases) + redis.call('ZCARD', queued)
  local samples = tonumber(f[7]) or 0
  if samples > 0 then mean = (tonumber(f[4]) or 0) / samples end
end
-- a sid asked twice in the call builds on what its first ask left it
local out, grant_args, granted_now, now_held, starved = {}, {}, 0, {}, false
for i = 1, n do
  local at = STRIDE * (i - 1)
  local sid, attempt, more = sids[i], ARGV[at + 2], tonumber(ARGV[at + 3]) or 0
  local least = math.min(more, tonumber(ARGV[at + 4]) or 0)
  local grant = now_held[sid] or tonumber(held[i]) or 0
  if owner[i] ~= attempt then
    out[i] = 0
  else
    local extra = 0
    if give and budget and mode ~= 'drain' then
      extra = grant_size(left, inflight, more, mean)
      if extra < least then
        extra = math.min(least, left)
        if extra < least then starved = true end
      end
    end
    if extra > 0 then
      left = left - extra
      grant = grant + extra
      granted_now = granted_now + extra
      grant_args[#grant_args + 1] = sid
      grant_args[#grant_args + 1] = grant
    end
    now_held[sid] = grant
    out[i] = grant
  end
end
if starved and f[8] ~= '1' then redis.call('HSET', ledger, 'starved', 1) end
if granted_now > 0 then
  redis.call('HSET', reserved, unpack(grant_args))
  redis.call('HINCRBY', ledger, 'reserved_tokens', granted_now)
end
return out
