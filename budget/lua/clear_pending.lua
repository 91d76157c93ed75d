-- clear_pending: after a pass over the whole source, the feeder takes back pending marks it cannot feed.
-- KEYS: ledger, pending, done, failed, queued, leases
-- ARGV: n_orphans, orphan sid1 .. sidN, then stale sids
-- Orphans were pending at the pass's start and are no longer in the source (its lines changed or were
-- removed): their marks go (unless queued or in flight now) and the ledger's not_in_source field counts
-- them. Stale ids are marks of samples that are done or failed by now: only those marks go.
-- Returns {orphans cleared, stale cleared}.
local n_orphans = tonumber(ARGV[1])
local orphans, stale = 0, 0
for i = 2, #ARGV do
  local sid = ARGV[i]
  if redis.call('HEXISTS', pending, sid) == 1 then
    local finished = redis.call('HEXISTS', done, sid) == 1 or redis.call('HEXISTS', failed, sid) == 1
    local busy = redis.call('ZSCORE', queued, sid) or redis.call('ZSCORE', leases, sid)
    if finished then
      redis.call('HDEL', pending, sid)
      stale = stale + 1
    elseif i <= n_orphans + 1 and not busy then
      redis.call('HDEL', pending, sid)
      orphans = orphans + 1
    end
  end
end
if orphans > 0 then redis.call('HINCRBY', ledger, 'not_in_source', orphans) end
return {orphans, stale}
