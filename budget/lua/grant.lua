-- grant: generations of a token budget ask for their grants when they have a server slot and are about to
-- be sent, ask for more when they reach them, and say when they end before them (Reservations in
-- _lib.lua). One call covers a worker process's asks of one dataset that came together: its cost in Redis
-- commands does not grow with their number.
-- KEYS: ledger, leases, owners, reserved, clock, done, live, pending, failed
-- ARGV: slots (the slots of the dataset's servers as the worker knows them; 0: unknown), then for each
--       ask: sid, attempt, kind, value:
--   start  (truncate) value: the most tokens its generation may produce: its first grant, now that it
--          has a server slot
--   whole  the same, for a generation that cannot be continued past a grant (a text prompt on a server
--          that cannot tokenize it): its whole want while that much is left; past that, as a start (cut
--          there; held for its whole want instead, such starts ran one at a time at the budget's end)
--   more   value: the most tokens more it may still produce: it reached its grant and its answer may go on
--   end    value: the tokens it produced in all: it ended before its grant, and the rest goes back now
--          (before its slot goes to the next generation, which is granted from it)
-- An end or more ask of a generation on the clock is also an observation of the dataset's speed: the
-- tokens it produced since its clock, and when (speed_observe).
-- Returns, per ask, the generation's grant in all after the call:
--   start  the grant (> 0); -3 where the budget's end has come: the attempt's lease is dropped here and
--          its sample is pending (reason limit), as release.lua would, so the hundreds of samples that
--          find the budget spent at once cost no call each; -1 where none may start now because the
--          dataset is not active (the worker gives it back with the state); -2 where all of the budget is
--          granted to running generations that will give some of it back (ask again in a moment)
--   more   more than before where the budget gives more; -2 where it has none now but a few others still
--          run that may give some back as they end (ask again in a moment; an ask of 0 more answers the
--          grant as it stands); the same where it has none to give (its answer ends there, cut)
--   end    1: what stays reserved for it is the tokens it produced, which its commit counts
--   0 for any ask of an attempt that no longer holds the lease (its generation must stop).
-- Asks that end come first, and what they give back is there for the others of the call.
local STRIDE = 4
local slots = tonumber(ARGV[1]) or 0
local n = (#ARGV - 1) / STRIDE
local sids = {}
for i = 1, n do sids[i] = ARGV[STRIDE * (i - 1) + 2] end
local f = redis.call('HMGET', ledger, 'state', 'token_budget', 'on_budget', 'tokens', 'discarded_tokens',
  'reserved_tokens', 'clock_n', 'clock_sum', 'clock_grant', 'gen_rate', 'gen_delay_ms', 'speed_n', 'speed_k',
  'speed_e', 'speed_kk', 'speed_ke')
local owner = redis.call('HMGET', owners, unpack(sids))
local held = redis.call('HMGET', reserved, unpack(sids))
local started = redis.call('HMGET', clock, unpack(sids))
local now = now_ms()
local state, budget, mode = f[1], tonumber(f[2] or ''), f[3]
local grants = budget ~= nil and mode ~= 'drain'
local left = 0
if grants then
  left = grant_pool(mode, budget) - (tonumber(f[4]) or 0) - (tonumber(f[5]) or 0) - (tonumber(f[6]) or 0)
end
local rate = tonumber(f[10]) or 0
local speed = {n = tonumber(f[12]) or 0, k = tonumber(f[13]) or 0, e = tonumber(f[14]) or 0,
  kk = tonumber(f[15]) or 0, ke = tonumber(f[16]) or 0}
local observed = speed.n
local clk = {tonumber(f[7]) or 0, tonumber(f[8]) or 0, tonumber(f[9]) or 0, rate, tonumber(f[11]) or 0}
local leased = redis.call('ZCARD', leases)

-- each sid's grant and clock as the call goes (a sid asked twice builds on its first ask)
local grant_of, start_of, kind_of, whole_of, out = {}, {}, {}, {}, {}
local coming = 0
for i = 1, n do
  local at = STRIDE * (i - 1) + 1
  local sid = sids[i]
  kind_of[i] = ARGV[at + 3]
  grant_of[sid] = grant_of[sid] or tonumber(held[i]) or 0
  if start_of[sid] == nil then start_of[sid] = tonumber(started[i]) or false end
  if (kind_of[i] == 'end' or kind_of[i] == 'more') and owner[i] == ARGV[at + 2] and start_of[sid] then
    -- what it produced since its clock: its grant (more: it reached it), or what it ended with
    local k = grant_of[sid]
    if kind_of[i] == 'end' then k = math.min(k, tonumber(ARGV[at + 4]) or 0) end
    speed_observe(speed, k, now - start_of[sid])
  end
  if kind_of[i] == 'whole' then kind_of[i] = 'start' whole_of[i] = true end
  if kind_of[i] == 'start' and owner[i] == ARGV[at + 2] then coming = coming + 1 end
end
if speed.n ~= observed then
  rate, clk[5] = speed_of(speed)
  clk[4] = rate
end

local d = {n = 0, sum = 0, grant = 0}
local reserved_delta = 0
local changed = {}

local function set_grant(sid, g)
  reserved_delta = reserved_delta + g - grant_of[sid]
  grant_of[sid] = g
  changed[sid] = true
end

local function clock_set(sid, start, g)
  local was = start_of[sid]
  local before = {n = d.n, sum = d.sum, grant = d.grant}
  if was then
    clock_delta(d, start, g, was, grant_of[sid])
  else
    clock_delta(d, start, g, nil, 0)
  end
  clk[1] = clk[1] + d.n - before.n
  clk[2] = clk[2] + d.sum - before.sum
  clk[3] = clk[3] + d.grant - before.grant
  start_of[sid] = start
end

local function clock_off(sid)
  local was = start_of[sid]
  if not was then return end
  d.n = d.n - 1
  d.sum = d.sum - was
  d.grant = d.grant - grant_of[sid]
  clk[1], clk[2], clk[3] = clk[1] - 1, clk[2] - was, clk[3] - grant_of[sid]
  start_of[sid] = false
end

-- the asks that end, first
for i = 1, n do
  local at = STRIDE * (i - 1) + 1
  local sid, attempt, value = sids[i], ARGV[at + 2], tonumber(ARGV[at + 4]) or 0
  if kind_of[i] == 'end' then
    if owner[i] ~= attempt then
      out[i] = 0
    else
      local g = grant_of[sid]
      clock_off(sid)
      local keep = math.min(g, math.max(0, value))
      if keep < g then
        left = left + g - keep
        set_grant(sid, keep)
      end
      out[i] = 1
    end
  end
end

for i = 1, n do
  local at = STRIDE * (i - 1) + 1
  local sid, attempt, value = sids[i], ARGV[at + 2], tonumber(ARGV[at + 4]) or 0
  local kind = kind_of[i]
  if kind == 'end' then
    -- answered above
  elseif owner[i] ~= attempt then
    out[i] = 0
  elseif kind == 'more' then
    local g = grant_of[sid]
    local add = 0
    local open = grants and (state == 'active' or state == 'exhausted') and value > 0
    if open and left > 0 then
      if mode == 'discard' then
        -- a whole want or nothing (admit.lua); the last one running takes what is left
        add = math.min(value, left)
      else
        local h = horizon(left, clk, now, coming, slots, leased)
        add = math.min(value, left, math.max(math.floor(h), MORE_MIN))
      end
    end
    local others = clk[1]
    if start_of[sid] then others = others - 1 end
    if add > 0 then
      left = left - add
      if start_of[sid] or mode == 'truncate' then
        -- it produced its grant: at the dataset's speed, its clock is that long ago (back on the clock
        -- where it waited); its next request's delay is still to come, as a new one's is
        local start = start_of[sid] or now
        if rate > 0 then start = now - math.floor(g * 1000 / rate) end
        clock_set(sid, start, g + add)
      end
      set_grant(sid, g + add)
      out[i] = grant_of[sid]
    elseif open and mode == 'truncate' and others > 0 and others <= MORE_WAIT_RUNNING then
      -- nothing left, and a few others run that may end before their grants: off the clock (it generates
      -- nothing while it waits), to ask again (MORE_WAIT_RUNNING)
      clock_off(sid)
      out[i] = -2
    else
      -- its answer ends at its grant: it generates nothing more
      if mode == 'truncate' then clock_off(sid) end
      out[i] = g
    end
  elseif kind == 'start' then
    coming = coming - 1
    local g = grant_of[sid]
    if g > 0 then
      out[i] = g  -- asked again (a retry): its grant stands
    elseif state == 'exhausted' and grants and mode == 'truncate' then
      out[i] = -3
    elseif state ~= 'active' or not grants or mode ~= 'truncate' then
      out[i] = -1
    else
      local want = math.max(1, value)
      local h, shared, h_all = horizon(left, clk, now, coming + 1, slots, leased, budget)
      local least = start_least(want, budget, shared)
      local give = 0
      if whole_of[i] and left >= want then
        give = want
      elseif h >= least then
        give = math.min(want, left, math.floor(h))
        if give < least then give = 0 end
      end
      if give == 0 and clk[1] == 0 and left > 0 then
        give = math.min(want, left)  -- none running: the last of the budget may start one
      end
      if give > 0 then
        left = left - give
        clock_set(sid, now, give)
        set_grant(sid, give)
        out[i] = give
      elseif h_all >= least then
        out[i] = -2  -- all granted, to generations that will give some back as they end
      else
        out[i] = -3
      end
    end
  else
    return redis.error_reply('grant: unknown kind ' .. tostring(kind))
  end
end

local grant_args, clock_args, clock_gone, written = {}, {}, {}, {}
for sid in pairs(changed) do
  grant_args[#grant_args + 1] = sid
  grant_args[#grant_args + 1] = grant_of[sid]
end
for i = 1, n do
  local sid = sids[i]
  local now_start, was = start_of[sid], tonumber(started[i])
  if not written[sid] then  -- a sid listed twice is written once
    written[sid] = true
    if now_start and now_start ~= was then
      clock_args[#clock_args + 1] = sid
      clock_args[#clock_args + 1] = now_start
    elseif not now_start and was then
      clock_gone[#clock_gone + 1] = sid
    end
  end
end
if #grant_args > 0 then redis.call('HSET', reserved, unpack(grant_args)) end
if reserved_delta ~= 0 then redis.call('HINCRBY', ledger, 'reserved_tokens', reserved_delta) end
if #clock_args > 0 then redis.call('HSET', clock, unpack(clock_args)) end
if #clock_gone > 0 then redis.call('HDEL', clock, unpack(clock_gone)) end
clock_apply(ledger, d)
if speed.n ~= observed then
  redis.call('HSET', ledger, 'gen_rate', rate, 'gen_delay_ms', clk[5], 'speed_n', speed.n,
    'speed_k', speed.k, 'speed_e', speed.e, 'speed_kk', speed.kk, 'speed_ke', speed.ke)
end

-- the starts the budget's end turned away (each held the lease: -3 follows the owner check above) are given
-- back as release.lua does; they hold no grant and have produced nothing
local dropped = false
for i = 1, n do
  if out[i] == -3 then
    drop_lease(ledger, leases, owners, live, reserved, clock, sids[i])
    pending_unless_finished(pending, done, failed, sids[i], 'limit')
    dropped = true
  end
end
if dropped then refresh_state(ledger) end
return out
