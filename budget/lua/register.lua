-- register: create a dataset or update its spec and limits (tokenfleet submit).
-- KEYS: ledger, spec
-- ARGV: spec_json, token_budget ("" = none), max_samples ("" = none), on_budget, max_new_tokens
-- Returns {state, then for each limit kept at the value set live: its field, that value ("" = none)}. A
-- paused or revoked dataset stays so; an exhausted one whose limits were raised becomes active again.
--
-- The newer intent wins, for each limit on its own. Submit is run again routinely (after a crash; compose
-- restarts the producer) with the config unchanged: a limit set live since (set_limits marks it
-- <limit>_set_live) is newer than that config, so it is kept while the config brings the value it brought
-- last time (config_<limit>). A config whose value changed was edited after the live change: its value
-- applies and the mark goes, as it does where nothing was set live. A dataset registered before
-- config_<limit> was recorded has none to compare: the config's value applies, as it always did.
redis.call('SET', spec, ARGV[1])
local kept = {}
for i, field in ipairs({'token_budget', 'max_samples'}) do
  local brought, mark, recorded = ARGV[i + 1], field .. '_set_live', 'config_' .. field
  local current = redis.call('HGET', ledger, field) or ''
  -- A live value equal to the config's is no longer a change to keep (nor to tell the user about).
  local newer = redis.call('HGET', ledger, mark) and redis.call('HGET', ledger, recorded) == brought
  if newer and current ~= brought then
    kept[#kept + 1] = field
    kept[#kept + 1] = current
  else
    redis.call('HSET', ledger, field, brought)
    redis.call('HDEL', ledger, mark)
  end
  redis.call('HSET', ledger, recorded, brought)
end
redis.call('HSET', ledger, 'on_budget', ARGV[4], 'max_new_tokens', ARGV[5], 'source_done', 0)
for _, f in ipairs({'tokens', 'samples', 'truncated', 'live_tokens', 'reserved_tokens', 'discarded_tokens',
                    'wasted_tokens', 'reclaimed', 'source_total', 'rejected'}) do
  redis.call('HSETNX', ledger, f, 0)
end
redis.call('HSETNX', ledger, 'state', 'active')
table.insert(kept, 1, refresh_state(ledger))
return kept
