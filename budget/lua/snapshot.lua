-- snapshot: one consistent read of a dataset for status and for submit's settle check.
-- KEYS: ledger, done, failed, queued, leases, pending
-- ARGV: (none)
-- Returns a flat list: the ledger hash's field/value pairs, then "done", n, "failed", n, "queued", n,
-- "inflight", n (leases not yet expired), "pending", n (given back, or expired leases). Empty when the dataset is unknown.
local ledger, done, failed, queued, leases, pending = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local out = redis.call('HGETALL', ledger)
if #out == 0 then return out end
local now = now_ms()
-- A lease that expired but was not reclaimed yet is a sample waiting to be fed again: pending.
local extra = {
  'done', redis.call('HLEN', done),
  'failed', redis.call('HLEN', failed),
  'queued', redis.call('ZCARD', queued),
  'inflight', redis.call('ZCOUNT', leases, '(' .. now, '+inf'),
  'pending', redis.call('HLEN', pending) + redis.call('ZCOUNT', leases, '-inf', now),
}
for _, v in ipairs(extra) do out[#out + 1] = v end
return out
