-- server_release: generations on a server ended (whatever their outcome): give their slots back and
-- count the requests in the server's rate. One call for the slots a worker process gave back together,
-- and for the slots it handed from an ended generation straight to a waiting one (no Redis call then:
-- they count as finished and as started here).
-- KEYS: slots, rate, health
-- ARGV: rate_window_s, handed_over, unused, then the tokens of the slots given back; the first `unused` of
--   them were taken but never used (a generation handed another slot meanwhile, or stopped): their start
--   is taken back, and they count as no request
-- Returns {held, now_ms}: held is how many slots were still ours (the others expired and were dropped: our
-- worker stopped renewing them for a lease), now_ms the Redis time of the release (orders outcome reports).
--
-- Rate hash fields: a ring of rate_window_s one-second buckets; bucket b = second % rate_window_s has
--   s<b>   the second (Unix time) the bucket counts
--   n<b>   requests finished in that second
local window, handed, unused = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local now = now_ms()
local tokens = {}
for i = 4, #ARGV do tokens[#tokens + 1] = ARGV[i] end
local held = 0
if #tokens > 0 then held = redis.call('ZREM', slots, unpack(tokens)) end
if handed - unused ~= 0 then redis.call('HINCRBY', health, 'started', handed - unused) end
local finished = #tokens - unused + handed
if finished > 0 then
  local second = math.floor(now / 1000)
  local b = second % window
  if tonumber(redis.call('HGET', rate, 's' .. b)) ~= second then
    redis.call('HSET', rate, 's' .. b, second, 'n' .. b, 0)
  end
  redis.call('HINCRBY', rate, 'n' .. b, finished)
end
return {held, now}
