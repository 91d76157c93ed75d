-- server_report: what a worker learned about a server's health: a generation's outcome or a probe's.
-- KEYS: health, probe
-- ARGV: outcome, at_ms, fail_threshold, probe_interval_ms, message
--   outcome   ok          a generation ended and the server answered (finished, stopped by us, or a 4xx)
--             fail        a generation failed on the server's side (transport error, 5xx, dropped stream,
--                         an abort we did not ask for): the runner retried it elsewhere
--             probe_ok    GET /health answered 200
--             probe_fail  GET /health did not
--   at_ms     when the generation ended (Redis time); 0 = now. Reports arrive late and out of order
--             (a success is told at its thread's next generation), so the streak is ordered by this
--             time: a failure older than the latest success is not part of the current streak.
--   fail_threshold     failures in a row that mark the server down
--   probe_interval_ms  once down, the first probe waits this long (then one probe per interval)
-- Returns {state, changed, fails}: state up | down after the report, changed 1 when this report marked it
-- up or down, fails the failures in a row.
--
-- Health hash fields:
--   state          up | down (absent: up)
--   fails          failures in a row (ordered by at_ms)
--   last_fail_ms   at_ms of the latest failure reported
--   last_ok_ms     at_ms of the latest success reported
--   failures       failures reported in total
--   downs          times the server was marked down
--   down_since_ms  when it was last marked down
--   up_since_ms    when it was last marked up again
--   last_error     the message of the latest failure or failed probe
--   started        slots taken in total (server_acquire)
--   cap            the cap the latest pick used (0 = none)
local outcome, threshold, interval = ARGV[1], tonumber(ARGV[3]), tonumber(ARGV[4])
local now = now_ms()
local at = tonumber(ARGV[2])
if at == 0 then at = now end
local down = redis.call('HGET', health, 'state') == 'down'
local fails = tonumber(redis.call('HGET', health, 'fails') or '0') or 0
local changed = 0

local function mark_up()
  redis.call('HSET', health, 'state', 'up', 'fails', 0, 'up_since_ms', now)
  redis.call('DEL', probe)
  down, fails, changed = false, 0, 1
end

if outcome == 'ok' then
  if at >= (tonumber(redis.call('HGET', health, 'last_fail_ms')) or 0) then
    fails = 0
    redis.call('HSET', health, 'fails', 0)
  end
  if at > (tonumber(redis.call('HGET', health, 'last_ok_ms')) or 0) then
    redis.call('HSET', health, 'last_ok_ms', at)
  end
  -- A generation that ended after the server was marked down proves it answers again.
  if down and at > (tonumber(redis.call('HGET', health, 'down_since_ms')) or 0) then mark_up() end
elseif outcome == 'fail' then
  redis.call('HINCRBY', health, 'failures', 1)
  redis.call('HSET', health, 'last_error', ARGV[5])
  if at >= (tonumber(redis.call('HGET', health, 'last_ok_ms')) or 0) then
    fails = fails + 1
    redis.call('HSET', health, 'fails', fails)
    if at > (tonumber(redis.call('HGET', health, 'last_fail_ms')) or 0) then
      redis.call('HSET', health, 'last_fail_ms', at)
    end
  end
  if not down and fails >= threshold then
    redis.call('HSET', health, 'state', 'down', 'down_since_ms', now)
    redis.call('HINCRBY', health, 'downs', 1)
    redis.call('SET', probe, now, 'PX', interval)
    down, changed = true, 1
  end
elseif outcome == 'probe_ok' then
  if down then mark_up() end
elseif outcome == 'probe_fail' then
  redis.call('HSET', health, 'last_error', ARGV[5])
else
  return redis.error_reply('server_report: unknown outcome ' .. outcome)
end
local state = 'up'
if down then state = 'down' end
return {state, changed, fails}
