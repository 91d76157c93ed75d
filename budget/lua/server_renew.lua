-- server_renew: keep the slots of running generations alive (each worker's picker calls it every quarter
-- lease). A slot that was dropped is not taken again: its place may be someone else's by now.
-- KEYS: slots_i for each slot i (its server's slots key)
-- ARGV: lease_ms, then token_i for each slot i
-- Returns a list: 1 for each slot renewed, 0 for each slot lost.
local expiry = now_ms() + tonumber(ARGV[1])
local out = {}
for i = 1, #KEYS do
  local token = ARGV[i + 1]
  -- Still there, even past its expiry: no pick dropped it since, so nobody was given its place.
  if redis.call('ZSCORE', KEYS[i], token) then
    redis.call('ZADD', KEYS[i], 'XX', expiry, token)
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
