-- server_acquire: take slots on the least-loaded servers, in one atomic step. The slots of a server are
-- fleet-wide (every worker process on every host takes them here), so its cap holds across the fleet.
-- One call takes a slot for each of several generations (a worker process's picks that came together):
-- each goes to the least-loaded server at its turn, counting the slots taken before it.
-- KEYS: seen, then for each server i (in ARGV order): slots_i, health_i
-- ARGV: tokens (joined by spaces), lease_ms, avoid ("" = none), first (1-based: where ties start, so they
--       spread), seen_ttl_ms, then for each server i: url_i, cap_i (0 = no cap)
-- Returns {urls, inflight, dirty}:
--   urls      for each token, the server its slot is on, joined by spaces ("-" when every candidate is at
--             its cap: wait and ask again)
--   inflight  slots on the last token's server now, its own included (0 when it got none)
--   dirty     the urls among the servers that are down or have failures in a row (a success on one of
--             them is worth reporting; on the others it changes nothing), joined by spaces
-- Candidates: the servers that are up (every server when none is: a down server is still better than
-- none), without `avoid` (the server a retry comes from) unless it is the only candidate. Among those
-- below their cap, the one with the fewest slots wins; ties go to the first from `first` on.
-- Expired slots (their holder stopped renewing them: a killed worker) are dropped first.
local tokens, lease_ms, avoid = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local first, seen_ttl_ms = tonumber(ARGV[4]), tonumber(ARGV[5])
local n = (#ARGV - 5) / 2
local now = now_ms()

-- Lean on purpose (one pick per generation): expired slots are dropped only when they could matter (a
-- server at its cap) and in one second of every 8; the seen set is touched once per SEEN_EVERY_MS.
local SEEN_EVERY_MS = 10000
local sweep = math.floor(now / 1000) % 8 == 0
local servers, up, dirty = {}, {}, {}
local seen_stale = false
for i = 1, n do
  local slots, health = KEYS[2 * i], KEYS[2 * i + 1]
  local s = {
    url = ARGV[4 + 2 * i], cap = tonumber(ARGV[5 + 2 * i]), slots = slots, health = health,
    inflight = redis.call('ZCARD', slots),
  }
  if sweep or (s.cap > 0 and s.inflight >= s.cap) then
    if redis.call('ZREMRANGEBYSCORE', slots, '-inf', now) > 0 then s.inflight = redis.call('ZCARD', slots) end
  end
  local state, fails, cap, seen_ms = unpack(redis.call('HMGET', health, 'state', 'fails', 'cap', 'seen_ms'))
  s.down = state == 'down'
  s.cap_known = tonumber(cap)
  if s.down or (tonumber(fails) or 0) > 0 then dirty[#dirty + 1] = s.url end
  servers[i] = s
  if not s.down then up[#up + 1] = s end
  if now - (tonumber(seen_ms) or 0) > SEEN_EVERY_MS then
    redis.call('ZADD', KEYS[1], now, s.url)
    redis.call('HSET', health, 'seen_ms', now)
    seen_stale = true
  end
end
if seen_stale then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - seen_ttl_ms) end

local pool = up
if #pool == 0 then pool = servers end
if #pool > 1 and avoid ~= '' then
  local others = {}
  for _, s in ipairs(pool) do
    if s.url ~= avoid then others[#others + 1] = s end
  end
  if #others > 0 then pool = others end
end

local dirty_list = table.concat(dirty, ' ')
local urls, inflight, taken = {}, 0, {}
for token in string.gmatch(tokens, '%S+') do
  local best = nil
  for k = 0, #pool - 1 do
    local s = pool[(first - 1 + k) % #pool + 1]
    if (s.cap == 0 or s.inflight < s.cap) and (best == nil or s.inflight < best.inflight) then best = s end
  end
  if best == nil then
    urls[#urls + 1] = '-'
    inflight = 0
  else
    best.inflight = best.inflight + 1
    inflight = best.inflight
    urls[#urls + 1] = best.url
    if not taken[best.url] then taken[best.url] = {server = best, args = {}} end
    local t = taken[best.url].args
    t[#t + 1] = now + lease_ms
    t[#t + 1] = token
  end
end
for _, t in pairs(taken) do
  redis.call('ZADD', t.server.slots, unpack(t.args))
  redis.call('HINCRBY', t.server.health, 'started', #t.args / 2)
  if t.server.cap_known ~= t.server.cap then redis.call('HSET', t.server.health, 'cap', t.server.cap) end
end
return {table.concat(urls, ' '), inflight, dirty_list}
