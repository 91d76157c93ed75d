-- release: an attempt gives its sample back without a result (revoked, discarded at the budget, or
-- stopped for another run); the sample becomes pending.
-- KEYS: ledger, done, leases, owners, live, reserved, clock, pending, failed
-- ARGV: sid, attempt, reason, thrown_away_tokens, counts_against_budget (0 | 1)
-- Returns the dataset's state, or "unknown".
local sid, attempt, n = ARGV[1], ARGV[2], tonumber(ARGV[4])
if not known(ledger) then return 'unknown' end
local grant = 0
if owns(owners, sid, attempt) then
  grant = tonumber(redis.call('HGET', reserved, sid) or '0') or 0
  drop_lease(ledger, leases, owners, live, reserved, clock, sid)
end
redis.call('HINCRBY', ledger, 'wasted_tokens', n)
if ARGV[5] == '1' then
  redis.call('HINCRBY', ledger, 'discarded_tokens', n)
  -- thrown away at its grant: it may have passed it by the step or two its abort took to land
  if grant > 0 and n > grant then redis.call('HINCRBY', ledger, 'overdrawn_tokens', n - grant) end
end
pending_unless_finished(pending, done, failed, sid, ARGV[3])
return refresh_state(ledger)
