-- hold: a generation is over but its record cannot be written (the output disk is full, a quota, a
-- read-only remount): keep the record here instead of throwing the generation away, until a worker can
-- write it (then it is committed as any other, by commit, and taken out by unhold). Its lease is kept
-- without expiry (score +inf: never reclaimed, renew never shortens it, admit answers "leased"), so the
-- sample is neither fed nor generated again, and the dataset is not settled while it is held. Its
-- reservation of a token budget shrinks to the tokens it generated: they are counted at its commit.
-- KEYS: ledger, done, leases, owners, live, reserved, clock, held
-- ARGV: sid, attempt, record (JSON), completion_tokens, max_bytes (the most the dataset's held records
--       may take in all)
-- Ledger fields: held (records held), held_bytes (their size).
-- Returns held (kept, or already held by this attempt) | full (no room under max_bytes: the caller gives
-- the sample back) | lost (this attempt holds no lease) | duplicate (already committed) | unknown.
-- Its live tokens stay as reported (status shows them in flight): commit counts the rest.
local sid, attempt, record = ARGV[1], ARGV[2], ARGV[3]
local tokens, max_bytes = tonumber(ARGV[4]) or 0, tonumber(ARGV[5]) or 0
if not known(ledger) then return 'unknown' end
if redis.call('HEXISTS', done, sid) == 1 then return 'duplicate' end
if not owns(owners, sid, attempt) then return 'lost' end
if redis.call('HEXISTS', held, sid) == 1 then return 'held' end
if num(ledger, 'held_bytes') + #record > max_bytes then return 'full' end
redis.call('HSET', held, sid, record)
redis.call('HINCRBY', ledger, 'held', 1)
redis.call('HINCRBY', ledger, 'held_bytes', #record)
redis.call('ZADD', leases, '+inf', sid)
local r = tonumber(redis.call('HGET', reserved, sid) or '0') or 0
if r ~= 0 then clock_remove(ledger, clock, {sid}, {r}) end  -- it generates no more
if r > tokens then
  redis.call('HSET', reserved, sid, tokens)
  redis.call('HINCRBY', ledger, 'reserved_tokens', tokens - r)
end
return 'held'
