-- output_problem: a worker reports that it cannot write a dataset's output (disk full, read-only, no
-- permission), or that it can again. Status, the metrics and submit's final table show the problem.
-- KEYS: ledger
-- ARGV: reporter (host:pid), problem ("" = solved: clears only the reporter's own problem); the records
--       held for the dataset are named after it
-- Ledger fields: output_error (the problem), output_error_by (who saw it), output_error_at (ms).
-- Returns 1 when the fields changed, else 0 (unknown dataset, or another reporter's problem stays).
local who, problem = ARGV[1], ARGV[2]
if not redis.call('HGET', ledger, 'state') then return 0 end
if problem == '' then
  if redis.call('HGET', ledger, 'output_error_by') ~= who then return 0 end
  redis.call('HDEL', ledger, 'output_error', 'output_error_by', 'output_error_at')
  return 1
end
-- Records held for want of room are named here, from the ledger's own count as this report lands: a worker
-- that read the count before a record was held (another thread's, or another process's) and reported last
-- would otherwise leave a problem that names none of them, and with the disk still full nothing reports
-- again.
local held = num(ledger, 'held')
if held > 0 then
  local bytes, size = num(ledger, 'held_bytes'), nil
  if bytes < 1024 then
    size = string.format('%d B', bytes)
  elseif bytes < 1024 * 1024 then
    size = string.format('%.1f KiB', bytes / 1024)
  else
    size = string.format('%.1f MiB', bytes / (1024 * 1024))
  end
  problem = problem .. '; ' .. held .. ' sample(s) held in the ledger (' .. size .. '), written once room comes back'
end
redis.call('HSET', ledger, 'output_error', problem, 'output_error_by', who, 'output_error_at', now_ms())
return 1
