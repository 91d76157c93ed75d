-- server_status: one read of every server's slots, rate and health, for `tokenfleet status`.
-- KEYS: for each server i: slots_i, health_i, rate_i
-- ARGV: rate_window_s, then url_i for each server i
-- Returns one entry per server: {url, inflight, finished in the last rate_window_s seconds (the current
-- one included), health hash as field/value pairs, now (Redis time, ms: the health's times are on the same
-- clock)}. Expired slots (a dead holder's) are not counted.
local window = tonumber(ARGV[1])
local now = now_ms()
local second = math.floor(now / 1000)
local out = {}
for i = 1, #KEYS / 3 do
  local slots, health, rate = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local finished = 0
  for b = 0, window - 1 do
    local s = tonumber(redis.call('HGET', rate, 's' .. b))
    if s and s > second - window then
      finished = finished + (tonumber(redis.call('HGET', rate, 'n' .. b)) or 0)
    end
  end
  out[i] = {ARGV[i + 1], redis.call('ZCOUNT', slots, '(' .. now, '+inf'), finished, redis.call('HGETALL', health),
    now}
end
return out
