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
--   reasoning_tokens  of the committed tokens, those the model spent thinking (SGLang's
--                     meta_info.reasoning_tokens); the rest are answer tokens. Both count against the budget
--   hit_max_new       committed samples whose generation ended at the dataset's max_new_tokens (not one
--                     cut short by its reservation of the budget: that one is truncated)
--   longest           the most completion tokens of one committed sample (caps the length percentiles)
--   live_tokens       tokens generated so far by in-flight attempts (sum of the live hash; workers report
--                     them every few seconds: for status only, never for a budget decision)
--   reserved_tokens   tokens reserved by in-flight attempts under a token budget (sum of the reserved
--                     hash): each generation is sent with max_new_tokens at most its reservation, so
--                     committed + discarded + reserved never exceeds the budget (reservations, below)
--   max_new_tokens    the dataset's max_new_tokens (discard reserves it whole for every generation)
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

-- Reservations. Under a token budget with policy truncate or discard, admit reserves tokens for each
-- generation and the worker sends it with max_new_tokens equal to its reservation, so the server itself
-- stops it there: committed + discarded + reserved <= budget holds at every moment, and no stream has to
-- be watched or aborted to keep the budget (no per-chunk ledger traffic). A finished generation gives
-- back what it did not use. truncate reserves min(max_new_tokens, what is left): the last generations
-- may be cut at the budget. discard reserves max_new_tokens whole, or nothing: no answer is ever cut, and
-- the budget counts as reached once less than max_new_tokens is left. drain reserves nothing and starts
-- a generation while committed + live + the expected rest of those running stay below the budget.

-- The smallest reservation a generation may start with under ``mode``, the dataset's max_new_tokens
-- being ``max_new`` (nil: no reservations).
local function floor_of(mode, max_new)
  if mode == 'discard' then return math.max(1, max_new) end
  if mode == 'drain' then return nil end
  return 1
end

local function reserve_floor(ledger, mode)
  local max_new = 0
  if mode == 'discard' then max_new = num(ledger, 'max_new_tokens') end
  return floor_of(mode, max_new)
end

-- Whether the token budget is reached with ``spent_tokens`` spent: less than the smallest reservation
-- ``floor`` left (nil, drain, which reserves nothing: no token left).
local function budget_reached(budget, spent_tokens, floor)
  return budget - spent_tokens < (floor or 1)
end

-- The reservation for one more generation that wants ``want`` tokens, given ``left`` unreserved tokens
-- of the budget: 0 when it may not start now.
local function reservation(mode, left, want)
  if mode == 'discard' then
    if left >= want then return want end
    return 0
  end
  if left <= 0 then return 0 end
  return math.min(want, left)
end

-- drain only: what the expected rule reads, {committed, live, mean committed length, in flight}.
local function drain_figures(ledger, leases)
  local samples = num(ledger, 'samples')
  local mean = 0
  if samples > 0 then mean = num(ledger, 'tokens') / samples end
  return {spent(ledger), num(ledger, 'live_tokens'), mean, redis.call('ZCARD', leases)}
end

-- drain only: whether starting one more generation could not fit in the budget, with what the running
-- ones (``inflight`` of them) are still expected to produce (the mean committed length each, less what
-- they produced). admit passes the generations its group admitted so far in ``inflight``.
local function drain_full(figures, inflight, budget)
  local committed, live, mean = figures[1], figures[2], figures[3]
  local expected = 0
  if mean > 0 and inflight > 0 then expected = math.max(0, inflight * mean - live) end
  return committed + live + expected >= budget
end

local function drain_blocked(ledger, leases, budget)
  local figures = drain_figures(ledger, leases)
  return drain_full(figures, figures[4], budget)
end

-- Whether no generation may start now for the token budget (enqueue asks before publishing).
local function budget_blocked(ledger, leases)
  local budget = limit(ledger, 'token_budget')
  if not budget then return false end
  local mode = redis.call('HGET', ledger, 'on_budget')
  local floor = reserve_floor(ledger, mode)
  if not floor then return drain_blocked(ledger, leases, budget) end
  return budget - spent(ledger) - num(ledger, 'reserved_tokens') < floor
end

-- Which committed limit is reached, or nil. Under discard the budget is reached once less than a whole
-- reservation (max_new_tokens) is left.
local function limit_reached(ledger)
  local budget = limit(ledger, 'token_budget')
  if budget then
    local floor = reserve_floor(ledger, redis.call('HGET', ledger, 'on_budget'))
    if budget_reached(budget, spent(ledger), floor) then return 'token_budget' end
  end
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

-- Remove a lease, its live tokens and its reservation. Returns the live tokens it held.
local function drop_lease(ledger, leases, owners, live, reserved, sid)
  local n = tonumber(redis.call('HGET', live, sid) or '0') or 0
  local r = tonumber(redis.call('HGET', reserved, sid) or '0') or 0
  redis.call('ZREM', leases, sid)
  redis.call('HDEL', owners, sid)
  if n ~= 0 then
    redis.call('HDEL', live, sid)
    redis.call('HINCRBY', ledger, 'live_tokens', -n)
  end
  if r ~= 0 then
    redis.call('HDEL', reserved, sid)
    redis.call('HINCRBY', ledger, 'reserved_tokens', -r)
  end
  return n
end

-- Take back leases whose holder stopped renewing them (a killed worker); the samples become pending.
local function reclaim_expired(ledger, leases, owners, live, reserved, pending, done, failed, now)
  local expired = redis.call('ZRANGEBYSCORE', leases, '-inf', now, 'LIMIT', 0, 256)
  for _, sid in ipairs(expired) do
    local n = drop_lease(ledger, leases, owners, live, reserved, sid)
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
-- RATE_KEEP_S seconds. The trim is looked at only in one second of every RATE_TRIM_EVERY_S (an HLEN per
-- call would be a command per commit for nothing); the ring then holds at most a few hundred fields.
local RATE_KEEP_S = 120
local RATE_TRIM_EVERY_S = 16
local function rate_add(hash, n, sec)
  if n <= 0 then return end
  if not sec then sec = tonumber(redis.call('TIME')[1]) end
  redis.call('HINCRBY', hash, sec, n)
  if sec % RATE_TRIM_EVERY_S == 0 and redis.call('HLEN', hash) > 2 * RATE_KEEP_S then
    for _, field in ipairs(redis.call('HKEYS', hash)) do
      if tonumber(field) < sec - RATE_KEEP_S then redis.call('HDEL', hash, field) end
    end
  end
end

-- Sum of a rate ring over the last window_s seconds, and the seconds it covers (at most window_s, less
-- when the ring is younger).
local function rate_sum(hash, window_s, sec)
  if not sec then sec = tonumber(redis.call('TIME')[1]) end
  -- the window's own fields only (HMGET), not the whole ring
  local fields = {}
  for s = sec - window_s + 1, sec do fields[#fields + 1] = s end
  local values = redis.call('HMGET', hash, unpack(fields))
  local total, oldest = 0, sec
  for i, v in ipairs(values) do
    if v then
      total = total + tonumber(v)
      if fields[i] < oldest then oldest = fields[i] end
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

-- Whether what runs must stop for the budget (truncate, discard): committed + discarded + reserved is
-- above it, which happens only when an operator lowered the budget (admit never reserves past it).
local function over_budget(ledger)
  local budget = limit(ledger, 'token_budget')
  if not budget or redis.call('HGET', ledger, 'on_budget') == 'drain' then return false end
  return spent(ledger) + num(ledger, 'reserved_tokens') > budget
end
