-- admit: a worker took a task (one sample, or a group of them) from the queue and asks which to generate.
-- One call for the whole group: its cost in Redis commands does not grow with the group's size.
-- KEYS: ledger, spec, done, queued, leases, owners, live, reserved, clock, pending, failed
-- ARGV: lease_ms, then for each sample: sid, attempt, want (the most tokens its generation may produce:
--       max_new_tokens, times the replies of a conversation that regenerates them all; 0: the dataset's
--       max_new_tokens), whole (1: its generation cannot be continued past a grant, a conversation or a
--       text prompt); want and whole are no longer read here (truncate grants at send time, discard
--       reserves nothing): the callers keep sending them
-- Returns {state, spec_json, verdict_1, cap_1, verdict_2, cap_2, ...}, per sample in order. verdict:
--   ok        generate; the caller holds the sample's lease until commit, fail or release
--   done      already committed (a second delivery); nothing to do
--   failed    already failed for good (a second delivery); nothing to do
--   leased    another attempt holds the lease right now (a duplicate delivery); nothing to do
--   paused | revoked | exhausted | limit    dropped without generation; the sample is pending again
--   unknown   the dataset is not in this ledger
-- cap: for an admitted sample under a truncate budget -1, granted at send time (grant.lua: Reservations in
-- _lib.lua); 0 otherwise (no token budget, discard, drain).
local lease_ms = tonumber(ARGV[1])
local STRIDE = 4
local n = (#ARGV - 1) / STRIDE
local sids = {}
for i = 1, n do sids[i] = ARGV[STRIDE * (i - 1) + 2] end
local now = now_ms()
redis.call('ZREM', queued, unpack(sids))
local state = redis.call('HGET', ledger, 'state')
if not state then
  local out = {'unknown', ''}
  for i = 1, n do out[#out + 1] = 'unknown'; out[#out + 1] = 0 end
  return out
end
reclaim_expired(ledger, leases, owners, live, reserved, clock, pending, done, failed, now)
local is_done = redis.call('HMGET', done, unpack(sids))
local is_failed = redis.call('HMGET', failed, unpack(sids))
local leased = redis.call('ZMSCORE', leases, unpack(sids))

local budget, mode, drain, discard, deferred = nil, nil, nil, nil, false
local max, taken, leased_before = nil, 0, 0
if state == 'active' then
  budget = limit(ledger, 'token_budget')
  if budget then
    mode = redis.call('HGET', ledger, 'on_budget')
    if mode == 'drain' then
      drain = drain_figures(ledger, leases)
    else
      leased_before = redis.call('ZCARD', leases)
      if mode == 'discard' then
        discard = discard_figures(ledger)
      else
        -- truncate: granted at send time (grant.lua); admitted while a new generation may start
        local left = grant_pool(mode, budget) - spent(ledger) - num(ledger, 'reserved_tokens')
        deferred = new_may_start(left, clock_figures(ledger), now, max_want(ledger), 0, 0, budget)
      end
    end
  end
  max = limit(ledger, 'max_samples')
  if max then taken = num(ledger, 'samples') + redis.call('ZCARD', leases) end
end

local out = {state, ''}
local back, ok_sids, lease_args, owner_args, seen = {}, {}, {}, {}, {}
for i = 1, n do
  local at = STRIDE * (i - 1) + 1
  local sid, attempt = sids[i], ARGV[at + 2]
  local verdict, cap = 'ok', 0
  if is_done[i] then
    verdict = 'done'
  elseif is_failed[i] then
    verdict = 'failed'
  elseif leased[i] or seen[sid] then
    verdict = 'leased'
  elseif state ~= 'active' then
    verdict = state
  elseif max and taken >= max then
    verdict = 'limit'
  elseif drain then
    -- each generation admitted before it in this group runs too (as if admitted one at a time)
    if drain_full(drain, drain[4] + #ok_sids, budget) then verdict = 'limit' end
  elseif discard then
    -- admitted while committed + live + the expected length of each generation in flight stay within the
    -- budget, each admitted before it in this group included (as if admitted one at a time); nothing
    -- reserved: it is sent with its whole want, and commit keeps the budget's slack (Reservations)
    if discard_full(discard, leased_before + #ok_sids + 1, budget) then verdict = 'limit' end
  elseif budget then
    if deferred then cap = -1 else verdict = 'limit' end
  end
  if verdict == 'ok' then
    taken = taken + 1
    ok_sids[#ok_sids + 1] = sid
    lease_args[#lease_args + 1] = now + lease_ms
    lease_args[#lease_args + 1] = sid
    owner_args[#owner_args + 1] = sid
    owner_args[#owner_args + 1] = attempt
    seen[sid] = true
  elseif verdict ~= 'done' and verdict ~= 'failed' and verdict ~= 'leased' then
    back[#back + 1] = sid
    back[#back + 1] = verdict
  end
  out[#out + 1] = verdict
  out[#out + 1] = cap
end
if #back > 0 then redis.call('HSET', pending, unpack(back)) end
if #ok_sids > 0 then
  redis.call('HDEL', pending, unpack(ok_sids))
  redis.call('ZADD', leases, unpack(lease_args))
  redis.call('HSET', owners, unpack(owner_args))
  out[2] = redis.call('GET', spec) or ''
end
return out
