-- purge_queue: take a dataset's waiting messages out of the Celery queue at once (revoke, pause, or a
-- limit reached), so they never reach a worker, and make their samples pending.
-- KEYS: queue (the broker's list, kombu's Redis transport), queued, pending
-- ARGV: dataset, reason
-- Returns how many messages were removed.
-- Message shape relied on (kombu Redis transport, Celery protocol 2): each list item is a JSON object
-- whose "headers" carry Celery's "stamps" ({"dataset": name}, see tokenfleet.publish) and our
-- "tf_sample_id" (or "tf_sample_ids" for a group task). Messages already reserved by a worker are not in
-- the list: admit drops those. Returns messages, not samples.
local dataset, reason = ARGV[1], ARGV[2]
local items = redis.call('LRANGE', queue, 0, -1)
local keep, removed = {}, 0
for _, raw in ipairs(items) do
  local ok, msg = pcall(cjson.decode, raw)
  local headers = ok and type(msg) == 'table' and msg['headers'] or nil
  local stamps = type(headers) == 'table' and headers['stamps'] or nil
  if type(stamps) == 'table' and stamps['dataset'] == dataset then
    removed = removed + 1
    for _, sid in ipairs(message_sample_ids(headers)) do
      if redis.call('ZREM', queued, sid) == 1 then redis.call('HSET', pending, sid, reason) end
    end
  else
    keep[#keep + 1] = raw
  end
end
if removed > 0 then
  redis.call('DEL', queue)
  for i = 1, #keep, 1000 do
    redis.call('RPUSH', queue, unpack(keep, i, math.min(i + 999, #keep)))
  end
end
return removed
