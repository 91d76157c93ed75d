-- renew: keep a lease alive while its generation runs (the worker's lease keeper calls it).
-- KEYS: leases, owners
-- ARGV: sid, attempt, lease_ms
-- Returns 1 when renewed, 0 when this attempt no longer holds the lease.
if not owns(owners, ARGV[1], ARGV[2]) then return 0 end
redis.call('ZADD', leases, 'XX', now_ms() + tonumber(ARGV[3]), ARGV[1])
return 1
