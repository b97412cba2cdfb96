-- A floor for a fixed window on Redis, for the bench only (never loaded by
-- the store): the least work any script can do that reads the server's
-- clock (TIME, as the store must) and counts (one write). TIME and INCRBY,
-- then a reply of the store's eight numbers; no window is ever started or
-- refused, so it is NOT a rate limiter, only what Redis spends on the two
-- commands our fixed window's common case cannot do without.
-- KEYS[1]: the key. ARGV: limit, window (µs), cost (as the store's script).
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local count = redis.call('INCRBY', KEYS[1], ARGV[3])
local limit = ARGV[1] + 0
return { 1, now, 1, limit, limit - count, ARGV[2] + 0, -1, 0 }
