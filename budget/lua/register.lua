-- register: create a dataset or update its spec and limits (tokenfleet submit).
-- KEYS: ledger, spec
-- ARGV: spec_json, token_budget ("" = none), max_samples ("" = none), on_budget, max_new_tokens
-- Returns the dataset's state. A paused or revoked dataset stays so; an exhausted one whose limits were
-- raised becomes active again.
redis.call('SET', spec, ARGV[1])
redis.call('HSET', ledger, 'token_budget', ARGV[2], 'max_samples', ARGV[3], 'on_budget', ARGV[4],
  'max_new_tokens', ARGV[5], 'source_done', 0)
for _, f in ipairs({'tokens', 'samples', 'truncated', 'live_tokens', 'reserved_tokens', 'discarded_tokens',
                    'wasted_tokens', 'reclaimed', 'source_total', 'rejected'}) do
  redis.call('HSETNX', ledger, f, 0)
end
redis.call('HSETNX', ledger, 'state', 'active')
return refresh_state(ledger)
