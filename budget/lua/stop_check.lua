-- stop_check: whether a dataset's in-flight generations must stop now (read only). Workers' stop
-- watchers ask it when told of a change on the stops channel, and every half second as a safety net.
-- KEYS: ledger
-- ARGV: (none)
-- Returns the reason to stop, or "" to go on:
--   revoked   the operator revoked the dataset
--   paused    the operator paused it (the samples go back to pending, fed again on resume)
--   budget    truncate: its budget was lowered below the tokens committed and reserved, so a grant no
--             longer fits and what runs is cut now; discard: what it keeps (and threw away) reached its
--             budget, or an operator lowered it there, and what still runs is thrown away now
--   max_samples  the committed samples reached the cap (lowered live below what ran): what still runs
--             could not be kept
--   unknown   the dataset is not in this ledger
-- One read (every worker process asks this twice a second for each dataset it has in flight).
local f = redis.call('HMGET', ledger, 'state', 'token_budget', 'on_budget', 'tokens', 'discarded_tokens',
  'reserved_tokens', 'overdrawn_tokens', 'max_samples', 'samples')
local state = f[1]
if not state then return 'unknown' end
if state == 'revoked' or state == 'paused' then return state end
-- over_budget's rule (_lib.lua), from the one read: tokens past grants (an abort's lag) are no lowering
if budget_stops(f[3], tonumber(f[2] or ''),
    (tonumber(f[4]) or 0) + (tonumber(f[5]) or 0) - (tonumber(f[7]) or 0) + (tonumber(f[6]) or 0)) then
  return 'budget'
end
if cap_stops(tonumber(f[8] or ''), tonumber(f[9]) or 0) then return 'max_samples' end
return ''
