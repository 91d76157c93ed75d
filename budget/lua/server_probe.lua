-- server_probe: which of these servers this worker should probe (GET /health) now: those marked down
-- whose probe key has expired. The key is set again here, so one worker probes each server per interval,
-- fleet-wide.
-- KEYS: for each server i: health_i, probe_i
-- ARGV: probe_interval_ms, then url_i for each server i
-- Returns the urls to probe.
local interval = tonumber(ARGV[1])
local now = now_ms()
local due = {}
for i = 1, #KEYS / 2 do
  local health, probe = KEYS[2 * i - 1], KEYS[2 * i]
  if redis.call('HGET', health, 'state') == 'down'
      and redis.call('SET', probe, now, 'NX', 'PX', interval) then
    due[#due + 1] = ARGV[i + 1]
  end
end
return due
