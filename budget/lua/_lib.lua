-- Shared helpers, prepended to every script by budget.scripts (Lua has no include for EVALSHA).
--
-- Ledger hash fields (KEYS ledger = tf:{name}:ledger:hash):
--   state             active | paused | exhausted | revoked
--   token_budget      completion tokens allowed ("" = none)
--   max_samples       committed samples allowed ("" = none)
--   on_budget         truncate | discard | drain
--   tokens            committed completion tokens
--   samples           committed samples
--   truncated         committed samples whose generation we cut at the budget
--   live_tokens       tokens generated so far by in-flight attempts (sum of the live hash)
--   discarded_tokens  tokens generated and thrown away by the discard policy (spent budget)
--   wasted_tokens     tokens generated and not committed for any reason (report only)
--   reclaimed         leases that expired (a worker died) and were taken back
--   source_total      samples the producer found in the source (after a full pass)
--   source_done       1 once the producer has read the whole source in this submit
--   rejected          source lines rejected by the producer
-- Times come from the Redis server's clock (TIME), so hosts' clocks never matter.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function num(ledger, field)
  return tonumber(redis.call('HGET', ledger, field) or '0') or 0
end

-- A limit field as a number, or nil when the dataset has none.
local function limit(ledger, field)
  local v = redis.call('HGET', ledger, field)
  if not v or v == '' then return nil end
  return tonumber(v)
end

-- Tokens that count against the budget: committed plus thrown away by the discard policy.
local function spent(ledger)
  return num(ledger, 'tokens') + num(ledger, 'discarded_tokens')
end

-- Whether starting one more generation could not fit in the token budget: committed plus live tokens plus
-- what the running generations are still expected to produce (the mean committed length of this
-- dataset, less what each has produced so far) reach it. Prompts are then not prefilled only to be cut
-- after a few tokens.
local function budget_blocked(ledger, leases)
  local budget = limit(ledger, 'token_budget')
  if not budget then return false end
  local live = num(ledger, 'live_tokens')
  local committed = spent(ledger)
  local expected = 0
  local samples = num(ledger, 'samples')
  local inflight = redis.call('ZCARD', leases)
  if samples > 0 and inflight > 0 then
    expected = math.max(0, inflight * (num(ledger, 'tokens') / samples) - live)
  end
  return committed + live + expected >= budget
end

-- Which committed limit is reached, or nil.
local function limit_reached(ledger)
  local budget = limit(ledger, 'token_budget')
  if budget and spent(ledger) >= budget then return 'token_budget' end
  local max = limit(ledger, 'max_samples')
  if max and num(ledger, 'samples') >= max then return 'max_samples' end
  return nil
end

-- active <-> exhausted from the limits; paused and revoked are left to the operator.
local function refresh_state(ledger)
  local state = redis.call('HGET', ledger, 'state')
  if state == 'active' or state == 'exhausted' then
    local want = 'active'
    if limit_reached(ledger) then want = 'exhausted' end
    if want ~= state then redis.call('HSET', ledger, 'state', want) end
    return want
  end
  return state
end

-- Remove a lease and its live tokens. Returns the live tokens it held.
local function drop_lease(ledger, leases, owners, live, sid)
  local n = tonumber(redis.call('HGET', live, sid) or '0') or 0
  redis.call('ZREM', leases, sid)
  redis.call('HDEL', owners, sid)
  redis.call('HDEL', live, sid)
  if n ~= 0 then redis.call('HINCRBY', ledger, 'live_tokens', -n) end
  return n
end

-- Take back leases whose holder stopped renewing them (a killed worker); the samples become pending.
local function reclaim_expired(ledger, leases, owners, live, pending, done, failed, now)
  local expired = redis.call('ZRANGEBYSCORE', leases, '-inf', now, 'LIMIT', 0, 256)
  for _, sid in ipairs(expired) do
    local n = drop_lease(ledger, leases, owners, live, sid)
    redis.call('HINCRBY', ledger, 'wasted_tokens', n)
    if redis.call('HEXISTS', done, sid) == 0 and redis.call('HEXISTS', failed, sid) == 0 then
      redis.call('HSET', pending, sid, 'lease_expired')
    end
  end
  if #expired > 0 then redis.call('HINCRBY', ledger, 'reclaimed', #expired) end
  return #expired
end

-- An attempt that ends after the dataset was forgotten must not bring its ledger back.
local function known(ledger)
  return redis.call('EXISTS', ledger) == 1
end

-- Per-second counters for rates (status, ETA): a ring of epoch-second fields, trimmed to the last
-- RATE_KEEP_S seconds whenever it grows past twice that.
local RATE_KEEP_S = 120
local function rate_add(hash, n)
  if n <= 0 then return end
  local t = redis.call('TIME')
  local sec = tonumber(t[1])
  redis.call('HINCRBY', hash, sec, n)
  if redis.call('HLEN', hash) > 2 * RATE_KEEP_S then
    for _, field in ipairs(redis.call('HKEYS', hash)) do
      if tonumber(field) < sec - RATE_KEEP_S then redis.call('HDEL', hash, field) end
    end
  end
end

-- Sum of a rate ring over the last window_s seconds, and the seconds it covers (at most window_s, less
-- when the ring is younger).
local function rate_sum(hash, window_s)
  local t = redis.call('TIME')
  local sec = tonumber(t[1])
  local total, oldest = 0, sec
  local flat = redis.call('HGETALL', hash)
  for i = 1, #flat, 2 do
    local s = tonumber(flat[i])
    if s > sec - window_s then
      total = total + tonumber(flat[i + 1])
      if s < oldest then oldest = s end
    end
  end
  return total, sec - oldest + 1
end

-- The sample ids a Celery message of ours carries in its headers (purge_queue, audit_queued):
-- "tf_sample_id" for one sample, "tf_sample_ids" for a group.
local function message_sample_ids(headers)
  if type(headers['tf_sample_ids']) == 'table' then return headers['tf_sample_ids'] end
  if type(headers['tf_sample_id']) == 'string' then return {headers['tf_sample_id']} end
  return {}
end

local function owns(owners, sid, attempt)
  return redis.call('HGET', owners, sid) == attempt
end
