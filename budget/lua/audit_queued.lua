-- audit_queued: find samples marked queued whose message is no longer in the broker's queue (a producer
-- killed between marking and publishing, or a worker killed after taking the message and before admit)
-- and make them pending, so a rerun or the running submit feeds them again. A message a live worker
-- holds may be counted lost this way; feeding it again is harmless (its second delivery is dropped).
-- KEYS: queue (the broker's list), queued, leases, done, pending
-- ARGV: dataset, older_than_ms (only entries queued at least this long ago are examined)
-- Returns how many samples were made pending.
-- Message shape relied on: as in purge_queue.lua (headers.stamps.dataset, headers.tf_sample_id).
local dataset = ARGV[1]
local before = now_ms() - tonumber(ARGV[2])
local old = redis.call('ZRANGEBYSCORE', queued, '-inf', before)
if #old == 0 then return 0 end
local present = {}
for _, raw in ipairs(redis.call('LRANGE', queue, 0, -1)) do
  local ok, msg = pcall(cjson.decode, raw)
  local headers = ok and type(msg) == 'table' and msg['headers'] or nil
  if type(headers) == 'table' and type(headers['stamps']) == 'table' and headers['stamps']['dataset'] == dataset then
    for _, sid in ipairs(message_sample_ids(headers)) do present[sid] = true end
  end
end
local lost = 0
for _, sid in ipairs(old) do
  if not present[sid] then
    redis.call('ZREM', queued, sid)
    if not redis.call('ZSCORE', leases, sid) and redis.call('HEXISTS', done, sid) == 0 then
      redis.call('HSET', pending, sid, 'lost_message')
      lost = lost + 1
    end
  end
end
return lost
