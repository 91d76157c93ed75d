-- server_acquire: take a slot on the least-loaded server, in one atomic step. The slots of a server are
-- fleet-wide (every worker process on every host takes them here), so its cap holds across the fleet.
-- KEYS: seen, then for each server i (in ARGV order): slots_i, health_i
-- ARGV: token, lease_ms, avoid ("" = none), first (1-based: where ties start, so they spread), seen_ttl_ms,
--       then for each server i: url_i, cap_i (0 = no cap)
-- Returns {url, inflight, dirty}:
--   url       the server the slot is on ("" when every candidate is at its cap: wait and ask again)
--   inflight  slots on url now, this one included (0 when url is "")
--   dirty     the urls among the servers that are down or have failures in a row (a success on one of
--             them is worth reporting; on the others it changes nothing), joined by spaces
-- Candidates: the servers that are up (every server when none is: a down server is still better than
-- none), without `avoid` (the server a retry comes from) unless it is the only candidate. Among those
-- below their cap, the one with the fewest slots wins; ties go to the first from `first` on.
-- Expired slots (their holder stopped renewing them: a killed worker) are dropped first.
local token, lease_ms, avoid = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local first, seen_ttl_ms = tonumber(ARGV[4]), tonumber(ARGV[5])
local n = (#ARGV - 5) / 2
local now = now_ms()

local servers, up, dirty = {}, {}, {}
for i = 1, n do
  local slots, health = KEYS[2 * i], KEYS[2 * i + 1]
  redis.call('ZREMRANGEBYSCORE', slots, '-inf', now)
  local s = {
    url = ARGV[4 + 2 * i], cap = tonumber(ARGV[5 + 2 * i]), slots = slots, health = health,
    inflight = redis.call('ZCARD', slots),
  }
  local state, fails = unpack(redis.call('HMGET', health, 'state', 'fails'))
  s.down = state == 'down'
  if s.down or (tonumber(fails) or 0) > 0 then dirty[#dirty + 1] = s.url end
  servers[i] = s
  if not s.down then up[#up + 1] = s end
  redis.call('ZADD', KEYS[1], now, s.url)
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - seen_ttl_ms)

local pool = up
if #pool == 0 then pool = servers end
if #pool > 1 and avoid ~= '' then
  local others = {}
  for _, s in ipairs(pool) do
    if s.url ~= avoid then others[#others + 1] = s end
  end
  if #others > 0 then pool = others end
end

local best = nil
for k = 0, #pool - 1 do
  local s = pool[(first - 1 + k) % #pool + 1]
  if (s.cap == 0 or s.inflight < s.cap) and (best == nil or s.inflight < best.inflight) then best = s end
end
local dirty_list = table.concat(dirty, ' ')
if best == nil then return {'', 0, dirty_list} end

redis.call('ZADD', best.slots, now + lease_ms, token)
redis.call('HINCRBY', best.health, 'started', 1)
redis.call('HSET', best.health, 'cap', best.cap)
return {best.url, best.inflight + 1, dirty_list}
