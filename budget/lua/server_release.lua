-- server_release: a generation on a server ended (whatever its outcome): give its slot back and count
-- the request in the server's rate.
-- KEYS: slots, rate
-- ARGV: token, rate_window_s
-- Returns {held, now_ms}: held is 1 when the slot was still ours (0: it expired and was dropped, our
-- worker stopped renewing it for a lease), now_ms the Redis time of the release (orders outcome reports).
--
-- Rate hash fields: a ring of rate_window_s one-second buckets; bucket b = second % rate_window_s has
--   s<b>   the second (Unix time) the bucket counts
--   n<b>   requests finished in that second
local window = tonumber(ARGV[2])
local now = now_ms()
local held = redis.call('ZREM', slots, ARGV[1])
local second = math.floor(now / 1000)
local b = second % window
if tonumber(redis.call('HGET', rate, 's' .. b)) ~= second then
  redis.call('HSET', rate, 's' .. b, second, 'n' .. b, 0)
end
redis.call('HINCRBY', rate, 'n' .. b, 1)
return {held, now}
