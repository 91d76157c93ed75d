-- set_state: the operator's pause, resume and revoke.
-- KEYS: ledger
-- ARGV: action (pause | resume | revoke)
-- Returns the new state, or "unknown". resume makes a paused or revoked dataset active (or exhausted
-- when its limits are reached).
local action = ARGV[1]
if not redis.call('HGET', ledger, 'state') then return 'unknown' end
if action == 'pause' then
  redis.call('HSET', ledger, 'state', 'paused')
elseif action == 'revoke' then
  redis.call('HSET', ledger, 'state', 'revoked')
elseif action == 'resume' then
  redis.call('HSET', ledger, 'state', 'active')
else
  return redis.error_reply('unknown action ' .. action)
end
return refresh_state(ledger)
