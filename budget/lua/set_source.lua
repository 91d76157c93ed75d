-- set_source: the producer's findings about the source (after a full pass, or as it goes).
-- KEYS: ledger
-- ARGV: source_total ("-" = unchanged), source_done (0 | 1 | "-"), rejected ("-" = unchanged)
if ARGV[1] ~= '-' then redis.call('HSET', ledger, 'source_total', ARGV[1]) end
if ARGV[2] ~= '-' then redis.call('HSET', ledger, 'source_done', ARGV[2]) end
if ARGV[3] ~= '-' then redis.call('HSET', ledger, 'rejected', ARGV[3]) end
return 1
