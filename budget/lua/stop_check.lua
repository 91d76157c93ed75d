-- stop_check: whether a dataset's in-flight generations must stop now (read only). Workers' stop
-- watchers ask it when told of a change on the stops channel, and every half second as a safety net.
-- KEYS: ledger
-- ARGV: (none)
-- Returns the reason to stop, or "" to go on:
--   revoked   the operator revoked the dataset
--   paused    the operator paused it (the samples go back to pending, fed again on resume)
--   budget    its budget was lowered below the tokens committed and reserved (policy truncate or
--             discard): a reservation no longer fits, so what runs is cut now
--   unknown   the dataset is not in this ledger
local state = redis.call('HGET', ledger, 'state')
if not state then return 'unknown' end
if state == 'revoked' or state == 'paused' then return state end
if over_budget(ledger) then return 'budget' end
return ''
