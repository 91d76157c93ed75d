-- unqueue: the producer could not publish samples it had marked queued; they become pending again.
-- KEYS: queued, pending
-- ARGV: reason, sid1, sid2, ...
-- Returns how many were in the queued set.
local n = 0
for i = 2, #ARGV do
  if redis.call('ZREM', queued, ARGV[i]) == 1 then
    redis.call('HSET', pending, ARGV[i], ARGV[1])
    n = n + 1
  end
end
return n
