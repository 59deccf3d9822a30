-- Reserves one call of a run against its fleet-wide budgets, atomically (see quota/runs.rs).
--
-- KEYS[1]: the run's hash (field 'first': the ms its first call came; one field per measure:
-- used plus reserved). KEYS[2]: its calls in flight, a sorted set of call id by expiry.
-- ARGV[1]: "" to read the store's clock (TIME), or a Unix ms time (tests).
-- ARGV[2..6]: the call's id, its ttl, the run's idle ttl, the runtime budget ("" none), the
-- parallel-calls budget ("" none); then a triple per measure: name, limit, demand.
-- Returns {1} when admitted, else {0, budget, limit, used}.
--
-- Both keys expire together, idle_ttl after the later of now and the last live call's expiry:
-- a run that has ended is gone, and the same id then starts a new run. A value that is not a
-- number counts as the limit (refused, never admitted on junk).

if redis.replicate_commands then
  redis.replicate_commands()
end

local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local run, calls = KEYS[1], KEYS[2]
local call, call_ttl, idle = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local runtime, parallel = tonumber(ARGV[5]), tonumber(ARGV[6])

if redis.call('TYPE', run).ok ~= 'hash' then redis.call('DEL', run) end
if redis.call('TYPE', calls).ok ~= 'zset' then redis.call('DEL', calls) end
redis.call('ZREMRANGEBYSCORE', calls, '-inf', string.format('%d', now))

local first = tonumber(redis.call('HGET', run, 'first')) or now
if runtime and now - first > runtime then
  return {0, 'runtime_ms', runtime, now - first}
end
for i = 7, #ARGV, 3 do
  local limit, demand = tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local stored = redis.call('HGET', run, ARGV[i])
  local used = 0
  if stored then used = tonumber(stored) or limit end
  if used + demand > limit then
    return {0, ARGV[i], limit, used}
  end
end
local live = redis.call('ZCARD', calls)
if parallel and live + 1 > parallel then
  return {0, 'parallel_calls', parallel, live}
end

redis.call('HSETNX', run, 'first', string.format('%d', first))
for i = 7, #ARGV, 3 do
  redis.call('HINCRBY', run, ARGV[i], ARGV[i + 2])
end
redis.call('ZADD', calls, string.format('%d', now + call_ttl), call)
local last = redis.call('ZRANGE', calls, -1, -1, 'WITHSCORES')
local until_ms = math.max(now, tonumber(last[2]) or now)
redis.call('PEXPIRE', run, string.format('%d', until_ms - now + idle))
redis.call('PEXPIRE', calls, string.format('%d', until_ms - now + idle))
return {1}
