-- server_release: generations on a server ended (whatever their outcome): give their slots back and
-- count the requests in the server's rate. One call for the slots a worker process gave back together.
-- KEYS: slots, rate
-- ARGV: rate_window_s, then the slots' tokens
-- Returns {held, now_ms}: held is how many slots were still ours (the others expired and were dropped: our
-- worker stopped renewing them for a lease), now_ms the Redis time of the release (orders outcome reports).
--
-- Rate hash fields: a ring of rate_window_s one-second buckets; bucket b = second % rate_window_s has
--   s<b>   the second (Unix time) the bucket counts
--   n<b>   requests finished in that second
local window = tonumber(ARGV[1])
local now = now_ms()
local tokens = {}
for i = 2, #ARGV do tokens[#tokens + 1] = ARGV[i] end
local held = redis.call('ZREM', slots, unpack(tokens))
local second = math.floor(now / 1000)
local b = second % window
if tonumber(redis.call('HGET', rate, 's' .. b)) ~= second then
  redis.call('HSET', rate, 's' .. b, second, 'n' .. b, 0)
end
redis.call('HINCRBY', rate, 'n' .. b, #tokens)
return {held, now}
