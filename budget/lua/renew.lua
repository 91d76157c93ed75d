-- renew: keep a worker process's leases alive, and report the tokens their generations have produced so
-- far (for status and rates; and for discard's admission while fewer answers are committed than run:
-- discard_exposure). One call per process and dataset every few seconds, for all its leases: no command
-- per streamed chunk.
-- KEYS: ledger, leases, owners, live, rate_tokens
-- ARGV: lease_ms, then for each lease: sid, attempt, live_tokens (generated so far by the attempt; "-":
--       not known, leave it)
-- Returns a list: 1 for each lease renewed, 0 for each this attempt no longer holds; then 1 where the
-- dataset wants its live tokens reported again soon (live_wanted_soon), else 0.
local lease_ms = tonumber(ARGV[1])
local n = (#ARGV - 1) / 3
local sids = {}
for i = 1, n do sids[i] = ARGV[3 * i - 1] end
local owner = redis.call('HMGET', owners, unpack(sids))
local was = redis.call('HMGET', live, unpack(sids))
local expiry = now_ms() + lease_ms
local out, lease_args, live_args = {}, {}, {}
-- delta: how the dataset's live tokens move; gained: tokens generated since the last report, for the rate
-- (a sample whose count went down, a try taken back for a retry, takes nothing off another's gain).
-- last: each sample's live tokens as this call leaves them (a sid listed twice counts from its last value)
local delta, gained, last = 0, 0, {}
for i = 1, n do
  if owner[i] == ARGV[3 * i] then
    local now_live = tonumber(ARGV[3 * i + 1])
    if now_live then
      local before = last[sids[i]]
      if before == nil then before = tonumber(was[i]) or 0 end
      delta = delta + now_live - before
      gained = gained + math.max(0, now_live - before)
      last[sids[i]] = now_live
      live_args[#live_args + 1] = sids[i]
      live_args[#live_args + 1] = now_live
    end
    lease_args[#lease_args + 1] = expiry
    lease_args[#lease_args + 1] = sids[i]
    out[i] = 1
  else
    out[i] = 0
  end
end
if #lease_args > 0 then
  -- GT: a held sample's lease (no expiry, budget/lua/hold.lua) is never shortened by a late renewal
  redis.call('ZADD', leases, 'XX', 'GT', unpack(lease_args))
  if #live_args > 0 then redis.call('HSET', live, unpack(live_args)) end
  if delta ~= 0 then redis.call('HINCRBY', ledger, 'live_tokens', delta) end
  rate_add(rate_tokens, gained)
end
out[n + 1] = 0
if live_wanted_soon(ledger, leases) then out[n + 1] = 1 end
return out
