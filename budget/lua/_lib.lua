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
--   tokens_sq         the sum of the squares of the committed samples' tokens (with tokens and samples:
--                     the length an answer in flight is expected to have, longer than the mean: discard)
--   live_tokens       tokens generated so far by in-flight attempts (sum of the live hash; workers report
--                     them every few seconds: for status only, never for a budget decision)
--   reserved_tokens   tokens reserved by in-flight attempts under a token budget (sum of the reserved
--                     hash: their grants): committed + discarded + reserved never exceeds the budget
--                     (reservations, below)
--   max_new_tokens    the dataset's max_new_tokens (the most one generation may want)
--   starved           1 once extend could not give a running generation what it asked (the budget's end:
--                     no new generation starts while some run; cleared when the limits change)
--   overdrawn_tokens  tokens committed past their generations' grants (a stream that reached its grant
--                     generates a step or two more before its abort lands): spent, but never reserved, so
--                     a lowered budget is judged without them
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

-- Reservations (grants). Under a token budget with policy truncate or discard, every generation in flight
-- holds a grant: tokens of the budget reserved for it (the reserved hash), never more in all than the
-- budget has left, so committed + discarded + reserved <= budget at every moment. A grant is not the
-- request's max_new_tokens: the request is sent with the dataset's own, and the worker watches its stream
-- against its grant. Before the stream reaches its grant the worker asks for more (extend.lua); where the
-- budget has none left, the worker aborts the request by its rid as it reaches its grant (truncate: the
-- answer is kept, cut; discard: thrown away, counted as spent). A finished generation gives back what it
-- did not use.
-- Grants are sized so that every server slot stays busy until the budget is spent (grant_size): the whole
-- max_new_tokens far from the end, about an answer's length near it, so what the generations in flight
-- hold unused stays small against what is left; admission goes on while an answer's worth is left beyond
-- what the running ones may still ask (room_for_new).
-- discard also admits a generation only while committed + live + the expected length of each generation
-- in flight stay within the budget (an answer it starts is expected to end whole), and grants from the
-- budget plus DISCARD_SLACK of it (whole answers may pass the budget by that much; one that would pass it
-- further is thrown away).
local GRANT_SHARE = 2
local GRANT_MIN = 16
local DISCARD_SLACK = 0.01

-- The tokens a budget of ``budget`` may grant in all under ``mode``.
local function grant_pool(mode, budget)
  if mode == 'discard' then return budget + math.floor(budget * DISCARD_SLACK) end
  return budget
end

-- The least budget a new generation needs under ``mode``, its dataset's max_new_tokens being ``max_new``
-- (0: SGLang's default, 128) and ``mean`` the length an answer in flight is expected to have (0: none
-- committed yet; discard_length): truncate, a token (its answer may be cut there); discard, an answer of
-- that length whole (the rule of discard_full with none in flight: the two never disagree); nil, drain.
local function floor_of(mode, max_new, mean)
  if mode == 'drain' then return nil end
  if mode ~= 'discard' then return 1 end
  if max_new <= 0 then max_new = 128 end
  if not mean or mean <= 0 then mean = max_new end
  return math.max(1, math.ceil(mean))
end

local function mean_length(ledger)
  local samples = num(ledger, 'samples')
  if samples > 0 then return num(ledger, 'tokens') / samples end
  return 0
end

-- discard only: the length an answer in flight is expected to have, from the committed ``tokens`` and the
-- sum of their squares: long answers stay in flight longer, so the answers in flight are a length-biased
-- draw, E[L^2] / E[L] of the committed lengths, not their mean (a third more for lengths with a lognormal
-- sigma of 0.5); the mean where the squares were not kept (a ledger rebuilt from the outputs, or older);
-- 0 before any is committed.
local function discard_length(tokens, tokens_sq, samples)
  if tokens > 0 and tokens_sq > 0 then return tokens_sq / tokens end
  if samples > 0 then return tokens / samples end
  return 0
end

local function reserve_floor(ledger, mode)
  return floor_of(mode, num(ledger, 'max_new_tokens'),
    discard_length(num(ledger, 'tokens'), num(ledger, 'tokens_sq'), num(ledger, 'samples')))
end

-- Whether the token budget is reached with ``spent_tokens`` spent: less than the smallest grant
-- ``floor`` left (nil, drain, which grants nothing: no token left).
local function budget_reached(budget, spent_tokens, floor)
  return budget - spent_tokens < (floor or 1)
end

-- A grant of up to ``want`` tokens, given ``left`` unreserved tokens of the pool, ``inflight`` generations
-- holding grants or about to (the dataset's leases and its queued tasks' samples) and ``mean`` the mean
-- committed length (0: none yet). Where the pool has room for every one of them to hold its whole want
-- GRANT_SHARE times over, the grant is the whole want: far from the budget's end nothing is ever asked
-- again. Nearer, a grant is about an answer's mean length (an eighth of the want before any answer is
-- committed), at most a 1/GRANT_SHARE share of what is left per generation, at least GRANT_MIN where
-- there is that much: what the generations in flight hold unused stays small against the budget left,
-- so the last of it goes to those that need it.
local function grant_size(left, inflight, want, mean)
  if want <= 0 or left <= 0 then return 0 end
  local share = math.floor(left / (GRANT_SHARE * math.max(1, inflight)))
  if share >= want then return math.min(want, left) end
  local step = math.ceil(mean or 0)
  if step <= 0 then step = math.ceil(want / 8) end
  return math.min(want, left, math.max(math.min(share, step), GRANT_MIN))
end

-- The budget a new generation may take its grant from, given ``left`` unreserved tokens of the pool and
-- ``leased`` generations running: 0 when it may not start now. A new generation leaves GRANT_MIN for each
-- one running (an answer under way is extended before a new one starts), and starts only where an answer
-- of the mean length (``mean``; an eighth of ``want`` before any) is left beyond that: one started with
-- less would be cut within a few tokens, a junk answer. Once a running answer asked for more and the
-- budget could not give it (``starved``), the budget's end has come: what is left goes to the answers
-- running, and a new one starts only where an answer's length is left for each of them (what answers cut
-- early or ending short give back, as fewer run), so answers are cut at the end and not in turns with new
-- ones, and the last ones do not run alone. With none running, whatever is left may start one.
local function room_for_new(left, leased, want, mean, starved)
  if left <= 0 then return 0 end
  if leased == 0 then return left end
  local room = left - GRANT_MIN * leased
  local step = math.ceil(mean or 0)
  if step <= 0 then step = math.ceil(want / 8) end
  local least = math.min(want, step)
  if starved then least = math.max(least, leased * step) end
  if room < least then return 0 end
  return room
end

-- drain only: what the expected rule reads, {committed, live, mean committed length, in flight}.
local function drain_figures(ledger, leases)
  return {spent(ledger), num(ledger, 'live_tokens'), mean_length(ledger), redis.call('ZCARD', leases)}
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

-- discard only: {committed + discarded, live, the length a generation in flight is expected to have in all
-- (discard_length; max_new_tokens before any is committed)}.
local function discard_figures(ledger)
  local mean = discard_length(num(ledger, 'tokens'), num(ledger, 'tokens_sq'), num(ledger, 'samples'))
  if mean <= 0 then mean = num(ledger, 'max_new_tokens') end
  if mean <= 0 then mean = 128 end
  return {spent(ledger), num(ledger, 'live_tokens'), mean}
end

-- discard only: whether ``n`` generations in flight (the one to start included) could not be expected to
-- end within the budget: what is spent, and what those in flight are expected to have in all, or what
-- they have produced where that is more (drain's rule, with discard's expected length).
local function discard_full(figures, n, budget)
  return figures[1] + math.max(figures[2], n * figures[3]) > budget
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
  if mode == 'drain' then return drain_blocked(ledger, leases, budget) end
  if mode == 'discard' and discard_full(discard_figures(ledger), redis.call('ZCARD', leases) + 1, budget) then
    return true
  end
  local left = grant_pool(mode, budget) - spent(ledger) - num(ledger, 'reserved_tokens')
  local want = num(ledger, 'max_new_tokens')
  if want <= 0 then want = 128 end
  local starved = redis.call('HGET', ledger, 'starved') == '1'
  return room_for_new(left, redis.call('ZCARD', leases), want, mean_length(ledger), starved) <= 0
end

-- Which committed limit is reached, or nil. The budget is reached once less than the least a new
-- generation needs is left (floor_of).
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
  return spent(ledger) - num(ledger, 'overdrawn_tokens') + num(ledger, 'reserved_tokens')
    > grant_pool(redis.call('HGET', ledger, 'on_budget'), budget)
end
