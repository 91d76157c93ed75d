-- commit: generations' records are written and flushed; count each, exactly once. One call commits a
-- batch (a worker process's generations that ended at about the same time): its cost in Redis commands
-- does not grow with the batch's size.
-- KEYS: ledger, done, leases, owners, live, reserved, clock, pending, rate_tokens, rate_samples, lengths
-- ARGV: for each generation: sid, attempt, completion_tokens, truncated (0 | 1), reasoning_tokens (of
-- completion_tokens, the model's thinking), hit_max_new (0 | 1: it ended at the dataset's max_new_tokens),
-- length bucket (of completion_tokens, computed by the caller: budget/lengths.py)
-- Returns {state, stop, outcome_1, outcome_2, ...}; stop: 1 where this batch made what still runs of the
-- dataset due to stop for its budget (budget_stops: a discard budget reached, or an answer thrown away
-- past its slack) or for its sample cap (reached with generations still running), so that the caller
-- announces it at once, else 0; outcome: committed | duplicate (already committed by
-- another attempt) | over_limit (max_samples already reached, or the attempt holds no reservation (it
-- lost its lease, or discard, which reserves none) and the token budget has no room for it: not counted,
-- so not exported) | revoked (the
-- operator stopped the dataset: nothing more of it is counted or exported; the sample is pending) |
-- unknown (forgotten).
-- A committed generation adds to the ledger's tokens, samples, truncated, reasoning_tokens and
-- hit_max_new and may raise its longest (one HSET for the batch), and adds to its bucket of the lengths
-- histogram (one HINCRBY when the batch's samples share one bucket, else one HMGET and one HSET for all
-- its buckets).
local STRIDE = 7
local n = #ARGV / STRIDE
local out = {}
local f = redis.call('HMGET', ledger, 'state', 'max_samples', 'tokens', 'samples', 'truncated',
  'live_tokens', 'reserved_tokens', 'wasted_tokens', 'token_budget', 'on_budget', 'discarded_tokens',
  'reasoning_tokens', 'hit_max_new', 'longest', 'max_new_tokens', 'overdrawn_tokens', 'tokens_sq')
local state = f[1]
-- an attempt that ends after the dataset was forgotten must not bring its ledger back
if not state then
  out[1] = 'unknown'
  out[2] = 0
  for i = 1, n do out[#out + 1] = 'unknown' end
  return out
end
local sids = {}
for i = 1, n do sids[i] = ARGV[STRIDE * (i - 1) + 1] end
local owner = redis.call('HMGET', owners, unpack(sids))
local live_of = redis.call('HMGET', live, unpack(sids))
local is_done = redis.call('HMGET', done, unpack(sids))
local max = tonumber(f[2] or '')
local tokens, samples, truncated = tonumber(f[3]) or 0, tonumber(f[4]) or 0, tonumber(f[5]) or 0
local live_tokens, reserved_tokens, wasted = tonumber(f[6]) or 0, tonumber(f[7]) or 0, tonumber(f[8]) or 0
local budget, mode = tonumber(f[9] or ''), f[10]
-- an attempt that lost its lease has no reservation: it is counted only where the budget still has room
local strict_budget = mode ~= 'drain' and budget or nil
local discarded = tonumber(f[11]) or 0
local reasoning, hit_max_new, longest = tonumber(f[12]) or 0, tonumber(f[13]) or 0, tonumber(f[14]) or 0
local overdrawn = tonumber(f[16]) or 0
local tokens_sq = tonumber(f[17]) or 0
local stopped_before = budget_stops(mode, budget, tokens + discarded - overdrawn + reserved_tokens)
local capped_before = cap_stops(max, samples)
-- reservations exist only while some are held (a dataset without a token budget never has any)
local reserved_of = {}
if reserved_tokens ~= 0 then reserved_of = redis.call('HMGET', reserved, unpack(sids)) end
local any_live = false

local dropped, done_args, committed_sids, back, committed_here, dropped_here = {}, {}, {}, {}, {}, {}
local dropped_grants = {}
local new_tokens, new_samples, thrown = 0, 0, 0
-- committed samples per length bucket in this batch, and the buckets in the order first seen
local per_bucket, buckets = {}, {}
out[1] = state
out[2] = 0
for i = 1, n do
  local at = STRIDE * (i - 1)
  local sid, attempt, k, cut = sids[i], ARGV[at + 2], tonumber(ARGV[at + 3]), ARGV[at + 4]
  local generated = k
  local holds = owner[i] == attempt
  local grant = 0
  if holds and not dropped_here[sid] then
    -- the tokens not reported live yet count as generated now; the reservation is given back (once: a
    -- sid listed twice in the batch must not give back its lease's live tokens and reservation twice)
    dropped_here[sid] = true
    local was_live = tonumber(live_of[i]) or 0
    if live_of[i] then any_live = true end
    generated = k - was_live
    live_tokens = live_tokens - was_live
    grant = tonumber(reserved_of[i]) or 0
    reserved_tokens = reserved_tokens - grant
    dropped[#dropped + 1] = sid
    dropped_grants[#dropped_grants + 1] = grant
  end
  new_tokens = new_tokens + math.max(0, generated)
  local outcome = 'committed'
  if is_done[i] or committed_here[sid] then
    outcome = 'duplicate'
  elseif state == 'revoked' then
    outcome = 'revoked'
    back[#back + 1] = sid
    back[#back + 1] = 'revoked'
  elseif max and samples >= max then
    -- the cap was lowered live below what ran: not kept, and pending (dropped by the limit while it
    -- holds; fed again if it is raised)
    outcome = 'over_limit'
    if holds then
      back[#back + 1] = sid
      back[#back + 1] = 'max_samples'
    end
  elseif (not holds or mode == 'discard') and strict_budget
      and tokens + discarded - overdrawn + reserved_tokens + k > grant_pool(mode, strict_budget) then
    -- discard reserves nothing: an answer that would pass the budget and its slack is thrown away whole,
    -- counted against the budget as discarded (as release.lua counts one stopped at the budget): the
    -- budget is then spent, so stop_check stops what still runs of the dataset at once (each would be
    -- thrown away too) instead of letting it run to its end
    outcome = 'over_limit'
    if holds and mode == 'discard' then
      discarded = discarded + k
      thrown = thrown + k
      back[#back + 1] = sid
      back[#back + 1] = 'discarded'
    end
  end
  if outcome == 'committed' then
    committed_here[sid] = true
    done_args[#done_args + 1] = sid
    done_args[#done_args + 1] = attempt
    committed_sids[#committed_sids + 1] = sid
    tokens = tokens + k
    tokens_sq = tokens_sq + k * k
    -- a stream stopped at its grant may pass it by the step or two its abort took to land
    if grant > 0 and k > grant then overdrawn = overdrawn + k - grant end
    samples = samples + 1
    new_samples = new_samples + 1
    if cut == '1' then truncated = truncated + 1 end
    reasoning = reasoning + (tonumber(ARGV[at + 5]) or 0)
    if ARGV[at + 6] == '1' then hit_max_new = hit_max_new + 1 end
    if k > longest then longest = k end
    local bucket = ARGV[at + 7]
    if not per_bucket[bucket] then
      per_bucket[bucket] = 0
      buckets[#buckets + 1] = bucket
    end
    per_bucket[bucket] = per_bucket[bucket] + 1
  else
    wasted = wasted + k
  end
  out[#out + 1] = outcome
end
if #dropped > 0 then
  redis.call('ZREM', leases, unpack(dropped))
  redis.call('HDEL', owners, unpack(dropped))
  if any_live then redis.call('HDEL', live, unpack(dropped)) end
  if #reserved_of > 0 then
    redis.call('HDEL', reserved, unpack(dropped))
    clock_remove(ledger, clock, dropped, dropped_grants)
  end
end
if #done_args > 0 then
  redis.call('HSET', done, unpack(done_args))
  redis.call('HDEL', pending, unpack(committed_sids))
end
if #back > 0 then redis.call('HSET', pending, unpack(back)) end
-- active <-> exhausted from the limits (the rule of limit_reached), from the figures in hand
if (new_samples > 0 or thrown > 0) and (state == 'active' or state == 'exhausted') then
  local reached = (max and samples >= max)
    or (budget and budget_reached(budget, tokens + discarded,
      floor_of(mode, tonumber(f[15]) or 0,
        discard_one(tokens, tokens_sq, samples, budget))))
  if reached then state = 'exhausted' else state = 'active' end
  out[1] = state
end
if (not stopped_before and budget_stops(mode, budget, tokens + discarded - overdrawn + reserved_tokens))
    or (not capped_before and cap_stops(max, samples) and redis.call('ZCARD', leases) > 0) then
  out[2] = 1
end
local fields = {'tokens', tokens, 'samples', samples, 'truncated', truncated,
  'live_tokens', live_tokens, 'reserved_tokens', reserved_tokens, 'wasted_tokens', wasted,
  'reasoning_tokens', reasoning, 'hit_max_new', hit_max_new, 'longest', longest, 'tokens_sq', tokens_sq}
if thrown > 0 then
  fields[#fields + 1] = 'discarded_tokens'
  fields[#fields + 1] = discarded
end
if overdrawn > 0 then
  fields[#fields + 1] = 'overdrawn_tokens'
  fields[#fields + 1] = overdrawn
end
if state ~= f[1] then
  fields[#fields + 1] = 'state'
  fields[#fields + 1] = state
end
redis.call('HSET', ledger, unpack(fields))
if #buckets == 1 then
  redis.call('HINCRBY', lengths, buckets[1], per_bucket[buckets[1]])
elseif #buckets > 1 then
  local counts = redis.call('HMGET', lengths, unpack(buckets))
  local args = {}
  for j, bucket in ipairs(buckets) do
    args[#args + 1] = bucket
    args[#args + 1] = (tonumber(counts[j]) or 0) + per_bucket[bucket]
  end
  redis.call('HSET', lengths, unpack(args))
end
local sec = tonumber(redis.call('TIME')[1])
rate_add(rate_tokens, new_tokens, sec)
rate_add(rate_samples, new_samples, sec)
return out
