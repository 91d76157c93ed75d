-- heartbeat: a worker process says it is alive (status lists workers and flags version mismatches).
-- KEYS: workers (hash name -> JSON)
-- ARGV: name, JSON of the worker's facts (version, code, host, pid, concurrency, inflight), or "" to
--       remove it (a clean shutdown)
-- Returns the Redis server's time in ms (stored as last_seen_ms, so hosts' clocks never matter).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if ARGV[2] == '' then
  redis.call('HDEL', workers, ARGV[1])
  return now
end
local facts = cjson.decode(ARGV[2])
facts['last_seen_ms'] = now
redis.call('HSET', workers, ARGV[1], cjson.encode(facts))
return now
