-- server_renew: keep the slots of running generations alive (each worker's picker calls it every quarter
-- lease). A slot that was dropped is not taken again: its place may be someone else's by now.
-- KEYS: slots_i for each slot i (its server's slots key)
-- ARGV: lease_ms, then token_i for each slot i
-- Returns a list: 1 for each slot renewed, 0 for each slot lost.
local expiry = now_ms() + tonumber(ARGV[1])
-- one ZMSCORE and one ZADD per server, whatever the number of its slots
local out, by_key = {}, {}
for i = 1, #KEYS do
  local k = KEYS[i]
  if not by_key[k] then by_key[k] = {} end
  local group = by_key[k]
  group[#group + 1] = i
end
for key, indexes in pairs(by_key) do
  local tokens = {}
  for _, i in ipairs(indexes) do tokens[#tokens + 1] = ARGV[i + 1] end
  -- Still there, even past its expiry: no pick dropped it since, so nobody was given its place.
  local scores = redis.call('ZMSCORE', key, unpack(tokens))
  local args = {}
  for j, i in ipairs(indexes) do
    if scores[j] then
      args[#args + 1] = expiry
      args[#args + 1] = tokens[j]
      out[i] = 1
    else
      out[i] = 0
    end
  end
  if #args > 0 then redis.call('ZADD', key, 'XX', unpack(args)) end
end
return out
