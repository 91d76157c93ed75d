-- progress: an attempt between two tries (or after its stream ended) asks whether to go on.
-- KEYS: ledger, leases, owners
-- ARGV: sid, attempt, lease_ms
-- Returns {action, state}: action is
--   continue  keep generating (the lease is renewed)
--   stop      the dataset was revoked or paused (state: revoked | paused), or what runs must stop for
--             a limit (limit_stop), with 'budget' in place of the state (truncate, a budget lowered below
--             what is committed and reserved; discard, a budget reached) or 'max_samples' (the sample cap
--             reached: what runs could not be kept)
--   lost      this attempt no longer holds the lease (it expired and was reclaimed)
local sid, attempt, lease_ms = ARGV[1], ARGV[2], tonumber(ARGV[3])
local state = redis.call('HGET', ledger, 'state') or 'unknown'
if not owns(owners, sid, attempt) then return {'lost', state} end
redis.call('ZADD', leases, 'XX', now_ms() + lease_ms, sid)
if state == 'revoked' or state == 'paused' then return {'stop', state} end
local why = limit_stop(ledger)
if why then return {'stop', why} end
return {'continue', state}
