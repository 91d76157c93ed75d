-- snapshot: one consistent read of a dataset for status and for submit's settle check.
-- KEYS: ledger, done, failed, queued, leases, pending, rate_tokens, rate_samples, lengths
-- ARGV: rate window in seconds
-- Returns a flat list: the ledger hash's field/value pairs, then "done", n, "failed", n, "queued", n,
-- "inflight", n (leases not yet expired), "pending", n (given back, or expired leases), then
-- "rate_tokens", tokens generated in the window, "rate_samples", samples committed in it, "rate_span_ms",
-- the milliseconds the window covers (from its oldest second's start to now, at least 1000), "now_ms",
-- Redis's time (the ledger's times, such as fed_at_ms, are on its clock), then "lengths", the lengths histogram as a flat list (bucket, samples, ...: budget/lengths.py). Empty when
-- the dataset is unknown.
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
local window = tonumber(ARGV[1]) or 30
local sec = math.floor(now / 1000)
local tokens_in_window, span = rate_sum(rate_tokens, window, sec)
local samples_in_window = rate_sum(rate_samples, window, sec)
-- The current second has run only now % 1000 ms: counted whole, it made a rate read early in a second up
-- to a second's worth too low (a third, over a 3 s span).
local span_ms = math.max(1000, span * 1000 - (1000 - now % 1000))
for _, v in ipairs({'rate_tokens', tokens_in_window, 'rate_samples', samples_in_window, 'rate_span_ms', span_ms,
                    'now_ms', now}) do
  extra[#extra + 1] = v
end
for _, v in ipairs(extra) do out[#out + 1] = v end
out[#out + 1] = 'lengths'
out[#out + 1] = redis.call('HGETALL', lengths)
return out
