-- unhold: held records a worker has written (and committed, or found committed already) are taken out
-- of the held hash (budget/lua/hold.lua).
-- KEYS: ledger, held
-- ARGV: sid, ...
-- Returns how many were held.
local count, bytes = 0, 0
for _, sid in ipairs(ARGV) do
  local size = redis.call('HSTRLEN', held, sid)
  if redis.call('HDEL', held, sid) == 1 then
    count = count + 1
    bytes = bytes + size
  end
end
if count > 0 and known(ledger) then
  redis.call('HINCRBY', ledger, 'held', -count)
  redis.call('HINCRBY', ledger, 'held_bytes', -bytes)
end
return count
