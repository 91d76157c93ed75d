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
--   clock_n, clock_sum, clock_grant    truncate: the generations granted at send time, the sum of their
--                     clocks (ms) and of their grants (clock hash; Reservations, below)
--   gen_rate          truncate: tokens/s one generation of the dataset gets, and
--   gen_delay_ms      the ms from a grant to its request's first token: the ledger's measure from when the
--                     generations ask (speed_observe), its state in speed_n, speed_k, speed_e, speed_kk and
--                     speed_ke
--   overdrawn_tokens  tokens committed past their generations' grants (a stream that reached its grant
--                     generates a step or two more before its abort lands): spent, but never reserved, so
--                     a lowered budget is judged without them
--   discarded_tokens  tokens generated and thrown away by the discard policy (spent budget)
--   wasted_tokens     tokens generated and not committed for any reason (report only)
--   reclaimed         leases that expired (a worker died) and were taken back
--   source_total      samples the producer found in the source (after a full pass)
--   source_done       1 once the producer has read the whole source in this submit
--   fed_at_ms         when a producer last said it feeds the dataset (fed.lua; Redis time): status
--                     tells a dataset with samples left and nothing feeding it
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
-- budget has left, so committed + discarded + reserved <= budget at every moment. Its request is sent with
-- max_new_tokens equal to its grant, so the server itself stops it there, whatever the load: no abort has
-- to land in time.
--
-- truncate: grants to a common deadline. A generation is granted its tokens when it has a server slot and
-- is about to be sent (grant.lua), not when its task is admitted (a worker holds about three samples per
-- slot: grants made at admission would sit with samples waiting for a slot). Continuous batching gives
-- every running request one token per decode step, so every generation of the dataset can be granted up
-- to the same moment: the horizon, the tokens still to generate (what is unreserved, plus what the running
-- generations have not yet used of their grants) over the generations that run (horizon below). Far from
-- the end the horizon is past max_new_tokens and a grant is the whole want. Nearer, a generation that ends
-- early gives back what it did not use at once (grant.lua's 'end', before its slot goes to the next one),
-- and the next one is granted up to the same horizon: so the servers stay full, and every answer still
-- running when the budget is spent reaches its grant then, and is cut there. An answer that reaches its
-- grant before (the horizon was estimated short) asks for more ('more') and goes on in a new request, the
-- prompt and its output so far, a prefix-cache hit (workers/continuation.py); where the budget has none
-- left, it ends there, cut.
-- How much of their grants the running generations have used is not reported per token: each one's
-- clock (the clock hash: when it would have started at the dataset's speed, on Redis's clock), the
-- dataset's speed per generation and the delay before a request's first token (gen_rate, gen_delay_ms:
-- speed_observe) say it.
--
-- discard reserves nothing: it admits a generation only while committed + live + what the generations in
-- flight are expected to need (their expected lengths, and DISCARD_SIGMAS spreads of their sum: discard_need)
-- stay within the budget (an answer it starts is expected to end whole), sends
-- it with its whole want, and keeps the budget plus DISCARD_SLACK of it at commit: an answer that would
-- pass that is not kept (commit.lua: over_limit, thrown away whole, never cut). Reserving each whole want
-- (max_new_tokens, 8-16x the mean) held the servers at (budget left) / max_new_tokens generations: 4.8x
-- the time of no budget at 64 in flight.
local DISCARD_SLACK = 0.01
local DISCARD_SIGMAS = 2
-- truncate: a new generation starts only where the horizon gives it this much (or its whole want, or an
-- equal share of the whole budget per generation where that is less: a budget too small for its slots):
-- one granted less would be cut within a few tokens, a junk answer; a continuation is granted at least
-- MORE_MIN where that much is left (each costs a request).
local NEW_MIN = 32
local MORE_MIN = 16
-- truncate: a generation that reached its grant and finds nothing left waits for what the others still
-- running give back as they end (grant.lua answers it -2, ask again) while at most this many of them run;
-- past that, it ends there, cut: another of the many will ask for what they give back. With a few left,
-- what the last of them gave back found no one to take it, and the budget ended short of being spent
-- (a budget of 120 on 12 conversations ended at 117 in a CI run, 2026-12-07).
local MORE_WAIT_RUNNING = 64
-- truncate: one observation's weight in the dataset's speed, and the observations before its delay is
-- fitted (speed_observe).
local RATE_WEIGHT = 0.05
local SPEED_FIT_MIN = 8

-- The tokens a budget of ``budget`` may grant in all under ``mode``.
local function grant_pool(mode, budget)
  if mode == 'discard' then return budget + math.floor(budget * DISCARD_SLACK) end
  return budget
end

-- The least budget a new generation needs under ``mode``, its dataset's max_new_tokens being ``max_new``
-- (0: SGLang's default, 128): truncate, a token (its answer may be cut there); discard, what one answer is
-- expected to need (``mean``: discard_one; max_new_tokens before any answer is committed); nil, drain.
local function floor_of(mode, max_new, mean)
  if mode == 'drain' then return nil end
  if mode ~= 'discard' then return 1 end
  -- discard admits a generation while what it is expected to need fits (admit.lua): one needs that much
  -- left (ceil: for a whole number left, left < ceil(x) exactly where left < x, as admit compares)
  if mean > 0 then return math.max(1, math.ceil(mean)) end
  if max_new <= 0 then max_new = 128 end
  return max_new
end

-- discard and drain: the length an answer in flight is expected to have, from the committed ``tokens`` and
-- the sum of their squares: long answers stay in flight longer, so the answers in flight are a
-- length-biased draw, E[L^2] / E[L] of the committed lengths, not their mean (a third more for lengths
-- with a lognormal sigma of 0.5); the mean where the squares were not kept (a ledger rebuilt from the
-- outputs, or older); 0 before any is committed.
local function inflight_length(tokens, tokens_sq, samples)
  if tokens > 0 and tokens_sq > 0 then return tokens_sq / tokens end
  if samples > 0 then return tokens / samples end
  return 0
end

-- discard only: the spread (standard deviation) of the committed lengths; 0 where unknown.
local function discard_spread(tokens, tokens_sq, samples)
  if samples <= 0 or tokens_sq <= 0 then return 0 end
  local mean = tokens / samples
  return math.sqrt(math.max(0, tokens_sq / samples - mean * mean))
end

-- discard only: what ``n`` answers in flight are expected to need in all, with a margin: n times the
-- expected length, plus DISCARD_SIGMAS spreads of their sum (sqrt(n) spreads): the answers it starts end
-- past the budget's slack (and are thrown away) rarely, not half the time. ``mean``: inflight_length.
local function discard_need(n, mean, spread)
  return n * mean + DISCARD_SIGMAS * spread * math.sqrt(n)
end

-- discard only: what one answer needs to be admitted (discard_full's rule for one) from the committed
-- figures: its expected length within the budget, and that plus DISCARD_SIGMAS spreads within the budget
-- and its slack (``budget``: the token budget, 0 where none); 0 before any is committed.
local function discard_one(tokens, tokens_sq, samples, budget)
  local mean = inflight_length(tokens, tokens_sq, samples)
  if mean <= 0 then return 0 end
  local margin = discard_need(1, mean, discard_spread(tokens, tokens_sq, samples))
  return math.max(mean, margin - math.floor(budget * DISCARD_SLACK))
end

local function reserve_floor(ledger, mode)
  return floor_of(mode, num(ledger, 'max_new_tokens'),
    discard_one(num(ledger, 'tokens'), num(ledger, 'tokens_sq'), num(ledger, 'samples'),
      limit(ledger, 'token_budget') or 0))
end

-- Whether the token budget is reached with ``spent_tokens`` spent: less than the smallest grant
-- ``floor`` left (nil, drain, which grants nothing: no token left).
local function budget_reached(budget, spent_tokens, floor)
  return budget - spent_tokens < (floor or 1)
end

-- truncate only: the clock of the generations granted at send time, as the ledger fields clock_n (how
-- many), clock_sum (the sum of their clocks, ms), clock_grant (the sum of their grants), gen_rate and
-- gen_delay_ms: {n, sum, grant, rate, delay}.
local function clock_figures(ledger)
  local f = redis.call('HMGET', ledger, 'clock_n', 'clock_sum', 'clock_grant', 'gen_rate', 'gen_delay_ms')
  return {tonumber(f[1]) or 0, tonumber(f[2]) or 0, tonumber(f[3]) or 0, tonumber(f[4]) or 0,
    tonumber(f[5]) or 0}
end

-- What the running generations (``clock``: clock_figures) have not yet used of their grants at ``now``:
-- their grants less what they produced at the dataset's speed since their clocks and its delay.
local function unused_grants(clock, now)
  local n, sum, grant, rate, delay = clock[1], clock[2], clock[3], clock[4], clock[5] or 0
  if n <= 0 or grant <= 0 then return 0 end
  local used = 0
  if rate > 0 then used = rate * (n * (now - delay) - sum) / 1000 end
  return grant - math.min(grant, math.max(0, used))
end

-- The least grant a new generation wanting ``want`` starts with, a pool of ``pool`` tokens being shared by
-- ``n`` generations (horizon): NEW_MIN, its whole want where less, an equal share of the pool where less.
local function start_least(want, pool, n)
  return math.max(1, math.min(want, NEW_MIN, math.floor(pool / math.max(1, n))))
end

-- The horizon: the tokens each generation running (``clock``'s, and ``coming`` about to start) may still
-- generate before the budget is spent, ``left`` being what is unreserved: what is left and unused, over
-- the number of them. Where fewer run than the servers take (a budget's first generations start a few at
-- a time, as their tasks are taken), the count is what will run: the slots of the dataset's servers
-- (``slots``, as the worker knows them), or where they are unknown the generations admitted
-- (``leased``): a first generation must not take what the next ones need. For a new generation
-- (``budget`` given: the whole budget) where that horizon is below what a new one needs (start_least, by
-- the slots) but what is unreserved (``left``) gives that much, the count is the running ones and as
-- many new ones as ``left`` gives that much each: the rest of a budget starts the generations it can,
-- instead of being held for slots it cannot fill. (Shared by every slot, the horizon fell below what a
-- new one needs while a few generations ran: every other start was turned away, and the rest was spent
-- by those few, each continued in turn. A budget of 6,000 tokens on 256 slots spent its second half one
-- generation at a time.)
-- Returns the horizon; the number of generations start_least shares the budget by; and the horizon
-- shared by every slot (whether a start turned away should wait for what the running ones give back).
local function horizon(left, clock, now, coming, slots, leased, budget)
  local running = clock[1]
  local pool = math.max(0, left) + unused_grants(clock, now)
  local expect = leased
  if slots > 0 then expect = slots end
  local shared = math.max(running + coming, expect, 1)
  local n = shared
  if budget then
    local least = start_least(NEW_MIN, budget, shared)
    if pool / shared < least and left >= least then
      -- the ones to start (this one and those still to come): the free slots, as many as left gives
      -- least each
      local starts = math.min(expect - running, math.floor(left / least))
      n = math.max(1, running + math.max(coming, starts))
    end
  end
  return pool / n, shared, pool / shared
end

-- truncate only: whether a new generation may start now, ``left`` tokens unreserved of a pool of ``pool``:
-- the budget is not all granted away to the generations running (what they hold unused counts: they give
-- it back as they end), and the horizon gives one at least start_least; with none running, whatever is
-- left may start one.
local function new_may_start(left, clock, now, want, slots, leased, pool)
  if clock[1] == 0 then return left > 0 end
  local h, n = horizon(left, clock, now, 0, slots, leased, pool)
  return h >= start_least(want, pool, n)
end

-- truncate only: a generation's clock set to ``start`` (ms), its grant in the clock's sum being ``grant``;
-- ``was``: its clock before (nil: it had none), its grant then being ``was_grant``. One HSET and one
-- HINCRBY per field changed (the callers batch theirs: clock_add below).
local function clock_delta(d, start, grant, was, was_grant)
  if was then
    d.sum = d.sum + start - was
    d.grant = d.grant + grant - was_grant
  else
    d.n = d.n + 1
    d.sum = d.sum + start
    d.grant = d.grant + grant
  end
end

local function clock_apply(ledger, d)
  if d.n ~= 0 then redis.call('HINCRBY', ledger, 'clock_n', d.n) end
  if d.sum ~= 0 then redis.call('HINCRBY', ledger, 'clock_sum', d.sum) end
  if d.grant ~= 0 then redis.call('HINCRBY', ledger, 'clock_grant', d.grant) end
end

-- Take ``sids`` off the clock (they ended, or lost their leases), ``grants`` their grants before (by
-- position). Cheap where the dataset has no clock.
local function clock_remove(ledger, clock, sids, grants)
  if #sids == 0 then return end
  local starts = redis.call('HMGET', clock, unpack(sids))
  local d, gone = {n = 0, sum = 0, grant = 0}, {}
  for i, s in ipairs(starts) do
    if s then
      d.n = d.n - 1
      d.sum = d.sum - tonumber(s)
      d.grant = d.grant - (tonumber(grants[i]) or 0)
      gone[#gone + 1] = sids[i]
    end
  end
  if #gone > 0 then
    redis.call('HDEL', clock, unpack(gone))
    clock_apply(ledger, d)
  end
end

-- truncate only: the dataset's speed as the ledger itself sees it, the one measure its clocks and horizons
-- use. A generation that asks (grant.lua: end, or more) having produced ``k`` tokens ``e`` ms after its clock
-- is one observation of e = delay + k * 1000 / rate: ``delay`` the ms from a grant to its request's first
-- token (the worker's send, the server's queue and prefill), ``rate`` the tokens/s one generation then gets.
-- Fitted over the observations (``s``: their weighted means of k, e, k^2 and k e, each new one weighing
-- RATE_WEIGHT; n, how many), as the speed and delay change with the load. Until the fit is sound (a few
-- observations whose lengths differ), and where it gives no sound delay (below 0, or half their mean time
-- or more: the speed changed under the observations, as over a fleet's ramp), the rate is their tokens
-- over their time and the delay 0. (The speed was once the workers' own, each request's tokens over its
-- e2e_latency: measured from the server's side, it left out the time from a grant to the server, and the
-- generations granted after the first wave ended up to 0.8 s before it; docs/budgets.md, 2026-12-07.)
local function speed_observe(s, k, e)
  if k <= 0 or e <= 0 then return end
  if s.n <= 0 then
    s.k, s.e, s.kk, s.ke = k, e, k * k, k * e
  else
    local w = RATE_WEIGHT
    s.k = s.k + w * (k - s.k)
    s.e = s.e + w * (e - s.e)
    s.kk = s.kk + w * (k * k - s.kk)
    s.ke = s.ke + w * (k * e - s.ke)
  end
  s.n = s.n + 1
end

-- The rate (tokens/s) and delay (ms) of speed_observe's observations ``s``: (0, 0) before any.
local function speed_of(s)
  if s.n <= 0 or s.k <= 0 or s.e <= 0 then return 0, 0 end
  local var = s.kk - s.k * s.k
  if s.n >= SPEED_FIT_MIN and var > (0.1 * s.k) ^ 2 then
    local ms_per_token = (s.ke - s.k * s.e) / var
    local delay = s.e - ms_per_token * s.k
    if ms_per_token > 0 and delay >= 0 and delay < 0.5 * s.e then return 1000 / ms_per_token, delay end
  end
  return 1000 * s.k / s.e, 0
end

-- The most tokens one generation of the dataset may want: its max_new_tokens (SGLang's default, 128,
-- where it has none).
local function max_want(ledger)
  local want = num(ledger, 'max_new_tokens')
  if want <= 0 then want = 128 end
  return want
end

-- drain and discard: of ``n`` answers in flight, how many the committed lengths (their mean ``mean``) speak
-- for, at most the ``answers`` committed, and what the rest are expected to need: their whole ``max_new``
-- each. Returns (trusted, tokens the others need).
local function trusted_and_beyond(n, mean, answers, max_new)
  local trusted = 0
  if mean > 0 then trusted = math.min(n, answers) end
  return trusted, (n - trusted) * max_new
end

-- drain only: what the expected rule reads, {committed, live, the length an answer in flight is expected
-- to have (inflight_length), in flight, answers committed, max_new_tokens}.
local function drain_figures(ledger, leases)
  return {spent(ledger), num(ledger, 'live_tokens'),
    inflight_length(num(ledger, 'tokens'), num(ledger, 'tokens_sq'), num(ledger, 'samples')),
    redis.call('ZCARD', leases),
    num(ledger, 'samples'), max_want(ledger)}
end

-- drain only: whether starting one more generation could not fit in the budget, with what the running
-- ones (``inflight`` of them) are expected to produce in all (or what they produced, where that is more).
-- As discard's (discard_full), the committed lengths say what an answer needs only for as many answers as
-- are committed, and each one in flight past that count is expected to need its whole max_new_tokens:
-- expecting nothing of the answers in flight before any was committed let a dataset at 1,024 in flight
-- start 2,000 answers against a 400k budget (831k tokens generated, measured 2026-12-05). admit passes
-- the generations its group admitted so far in ``inflight``.
local function drain_full(figures, inflight, budget)
  local committed, live, mean = figures[1], figures[2], figures[3]
  local trusted, beyond = trusted_and_beyond(inflight, mean, figures[5], figures[6])
  return committed + math.max(live, trusted * mean + beyond) >= budget
end

-- discard only: {committed + discarded, live, the length a generation in flight is expected to have in all
-- (inflight_length), the spread of the lengths, the answers committed, max_new_tokens, the tokens
-- committed}.
local function discard_figures(ledger)
  local tokens, tokens_sq, samples = num(ledger, 'tokens'), num(ledger, 'tokens_sq'), num(ledger, 'samples')
  local max_new = num(ledger, 'max_new_tokens')
  if max_new <= 0 then max_new = 128 end
  return {spent(ledger), num(ledger, 'live_tokens'), inflight_length(tokens, tokens_sq, samples),
    discard_spread(tokens, tokens_sq, samples), samples, max_new, tokens}
end

-- discard only: what each answer in flight is expected to need while fewer answers are committed than
-- run, from the tokens generated so far (``tokens`` committed, ``live`` in flight) over the answers
-- committed (``answers``): the answers in flight count with what they have generated, as answers not
-- yet ended (time at risk over endings, the estimate of a constant ending rate). Early in a run the
-- first answers to end are the short ones, and this is far above the true length (it counts all the
-- tokens and only the short endings), but far below max_new_tokens, which trusted_and_beyond expects of
-- each answer past the committed count: the servers fill in a few answers' time instead of after as many
-- answers were committed as run (the model, bench/discard_limit.py: 1.44x -> 1.32x at mean 400 and 256
-- in flight). At least the committed lengths' length-biased mean (``mean``), at most ``max_new``. Read
-- only once live tokens were reported (before that, the answers in flight would count as nothing), and
-- reported every second while it is read (live_wanted_soon).
local function discard_exposure(tokens, live, answers, mean, max_new)
  return math.min(max_new, math.max(mean, (tokens + live) / answers))
end

-- Whether the workers should report the dataset's live tokens again within a second instead of a few:
-- a discard budget while fewer answers are committed than run, where admission reads them
-- (discard_exposure). A report 5 s old counts an answer of 400 tokens at 10 ms a token as nothing: the
-- estimate is then the committed answers' mean, the short ones', and starts too many (the model at 1,024
-- in flight: 155k of a 400k budget thrown away with reports every 500 steps, 61k every 100).
local function live_wanted_soon(ledger, leases)
  if redis.call('HGET', ledger, 'on_budget') ~= 'discard' or not limit(ledger, 'token_budget') then
    return false
  end
  return num(ledger, 'samples') < redis.call('ZCARD', leases)
end

-- discard only: whether ``n`` generations in flight (the one to start included) could not be expected to
-- end within the budget: what is spent, plus what those in flight are expected to need in all (or what they
-- have produced where that is more, drain's rule), must stay within the budget, and with DISCARD_SIGMAS
-- spreads of their sum (discard_need) within the budget and its slack: on average the answers land at the
-- budget, and rarely past the slack (where they are thrown away). The committed lengths say what an answer
-- needs only for as many answers as are committed: the first to end are the short ones (at 1,024 in flight
-- and a 400k budget, trusting them for all started far more than the budget held, and 390k tokens were
-- thrown away); each answer in flight past that count is expected to need its whole max_new_tokens. Trusting
-- them for none until as many were committed as run held the servers at a fraction of their slots for
-- most of a short run (4.7x the time of no budget at 256 in flight); this rule trusts them step by step.
local function discard_full(figures, n, budget)
  local spent, live, mean, spread, answers = figures[1], figures[2], figures[3], figures[4], figures[5]
  local trusted, beyond = trusted_and_beyond(n, mean, answers, figures[6])
  local expected = trusted * mean + beyond
  local need = beyond
  if trusted > 0 then need = need + discard_need(trusted, mean, spread) end
  if beyond > 0 and answers > 0 and live > 0 then
    -- fewer committed than run: each at what the tokens so far say (discard_exposure), where that is less
    local each = discard_exposure(figures[7], live, answers, mean, figures[6])
    if n * each < expected then expected, need = n * each, discard_need(n, each, spread) end
  end
  if spent + math.max(live, expected) > budget then return true end
  return spent + math.max(live, need) > budget + math.floor(budget * DISCARD_SLACK)
end

-- How many more samples the token budget lets enqueue publish, at most ``room`` (0: no generation may
-- start now). discard and drain count those queued as in flight: each is admitted by their rule
-- (discard_full, drain_full), and one published past it would be refused at admission and wait as
-- pending until all in flight ended (the producer reads the source again only then: drain at 256 in
-- flight, 3.4x the time of no budget with the servers mostly idle). Truncate gates the next one only:
-- it grants at send time.
local function budget_room(ledger, leases, queued, room)
  local budget = limit(ledger, 'token_budget')
  if not budget then return room end
  local mode = redis.call('HGET', ledger, 'on_budget')
  local blocked
  if mode == 'drain' or mode == 'discard' then
    -- what is expected grows with the number in flight: the most that fit, by bisection (drain's rule
    -- counts those running before the one it starts, discard's that one too)
    local base = redis.call('ZCARD', leases) + redis.call('ZCARD', queued)
    local figures, full, before = nil, discard_full, 0
    if mode == 'drain' then
      figures, full, before = drain_figures(ledger, leases), drain_full, 1
    else
      figures = discard_figures(ledger)
    end
    local lo, hi = 0, room
    while lo < hi do
      local mid = math.floor((lo + hi + 1) / 2)
      if full(figures, base + mid - before, budget) then hi = mid - 1 else lo = mid end
    end
    return lo
  else
    local left = grant_pool(mode, budget) - spent(ledger) - num(ledger, 'reserved_tokens')
    blocked = not new_may_start(left, clock_figures(ledger), now_ms(), max_want(ledger), 0, 0, budget)
  end
  if blocked then return 0 end
  return room
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

-- Remove a lease, its live tokens, its reservation and its clock. Returns the live tokens it held.
local function drop_lease(ledger, leases, owners, live, reserved, clock, sid)
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
    clock_remove(ledger, clock, {sid}, {r})
  end
  return n
end

-- A sample given back without a result is pending with ``reason``, unless it is done or failed already.
local function pending_unless_finished(pending, done, failed, sid, reason)
  if redis.call('HEXISTS', done, sid) == 0 and redis.call('HEXISTS', failed, sid) == 0 then
    redis.call('HSET', pending, sid, reason)
  end
end

-- Take back leases whose holder stopped renewing them (a killed worker); the samples become pending.
local function reclaim_expired(ledger, leases, owners, live, reserved, clock, pending, done, failed, now)
  local expired = redis.call('ZRANGEBYSCORE', leases, '-inf', now, 'LIMIT', 0, 256)
  for _, sid in ipairs(expired) do
    local n = drop_lease(ledger, leases, owners, live, reserved, clock, sid)
    redis.call('HINCRBY', ledger, 'wasted_tokens', n)
    pending_unless_finished(pending, done, failed, sid, 'lease_expired')
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

-- Whether what runs of a dataset must stop for its ``budget`` under ``mode``, ``used`` being committed +
-- discarded - overdrawn + reserved. truncate: once that is above the budget, which only an operator's
-- lowering does (grants never pass it). discard: once it reaches the budget. The answers kept then fill
-- it, and one still running could only be kept within the slack, or thrown away past it, after the wait
-- for the longest of them; stopped now (thrown away, counted against the budget), it costs no more GPU
-- time, and the budget's tail ends (docs/budgets.md: the model and the runs before and after). drain:
-- never.
local function budget_stops(mode, budget, used)
  if not budget or mode == 'drain' then return false end
  if mode == 'discard' then return used >= budget end
  return used > grant_pool(mode, budget)
end

-- Whether what runs must stop for the budget now (budget_stops, from the ledger).
local function over_budget(ledger)
  return budget_stops(redis.call('HGET', ledger, 'on_budget'), limit(ledger, 'token_budget'),
    spent(ledger) - num(ledger, 'overdrawn_tokens') + num(ledger, 'reserved_tokens'))
end

-- Whether what runs must stop for the sample cap: ``samples`` committed reached ``max`` (nil: no cap).
-- Admission never lets more run than the cap has room for; an operator who lowers it live leaves some
-- running that no commit could keep (commit.lua: over_limit), so they stop now, not at their end.
local function cap_stops(max, samples)
  return max ~= nil and samples >= max
end

-- Why what runs of an active (or exhausted) dataset must stop now: 'budget', 'max_samples', or nil.
local function limit_stop(ledger)
  if over_budget(ledger) then return 'budget' end
  if cap_stops(limit(ledger, 'max_samples'), num(ledger, 'samples')) then return 'max_samples' end
  return nil
end
