-- A run's fleet-wide budgets in the store, one atomic call each (see quota/runs.rs).
--
-- A run is a hash (field 'first': the ms its first call came; one field per measure: used plus
-- reserved) and its calls in flight, a sorted set of call id by expiry (`<run>:calls`). Both
-- expire together, idle_ttl after the later of now and the last live call's expiry: a run that
-- has ended is gone, and the same id then starts a new run.
--
-- ARGV[1]: 'reserve' or 'settle'. ARGV[2]: "" to read the store's clock (TIME), or a Unix ms
-- time (tests).
--
-- reserve: KEYS[1], KEYS[2]: the run's hash and calls. ARGV[3..7]: the call's id, its ttl, the
-- run's idle ttl, the runtime budget ("" none), the parallel-calls budget ("" none); then a
-- triple per measure: name, limit, demand. Checks every budget, then adds the demand and the
-- call; returns {1} when admitted, else {0, budget, limit, used}. A stored value that is not a
-- number counts as the limit (refused, never admitted on junk).
--
-- settle: KEYS[2i-1], KEYS[2i]: the i-th call's run hash and calls. Then per call: its id, the
-- run's idle ttl, the number of measures, and per measure: name, reserved, used. Returns the
-- number of calls settled. A call is settled once, and only while it is among its run's calls
-- in flight: a settle that comes after the call's entry lapsed, after the run ended, or before
-- the call was reserved, changes nothing (what the call reserved stays charged: never an
-- overshoot).

if redis.replicate_commands then
  redis.replicate_commands()
end

local now = tonumber(ARGV[2])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function int(x)
  return string.format('%d', x)
end

-- Both keys expire idle ms after the later of now and the last live call's expiry.
local function expire(run, calls, idle)
  local last = redis.call('ZRANGE', calls, -1, -1, 'WITHSCORES')
  local until_ms = math.max(now, tonumber(last[2]) or now)
  redis.call('PEXPIRE', run, int(until_ms - now + idle))
  redis.call('PEXPIRE', calls, int(until_ms - now + idle))
end

local function reserve()
  local run, calls = KEYS[1], KEYS[2]
  local call, call_ttl, idle = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
  local runtime, parallel = tonumber(ARGV[6]), tonumber(ARGV[7])
  if redis.call('TYPE', run).ok ~= 'hash' then redis.call('DEL', run) end
  if redis.call('TYPE', calls).ok ~= 'zset' then redis.call('DEL', calls) end
  redis.call('ZREMRANGEBYSCORE', calls, '-inf', int(now))
  local first = tonumber(redis.call('HGET', run, 'first')) or now
  if runtime and now - first > runtime then
    return {0, 'runtime_ms', runtime, now - first}
  end
  for i = 8, #ARGV, 3 do
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
  redis.call('HSETNX', run, 'first', int(first))
  for i = 8, #ARGV, 3 do
    redis.call('HINCRBY', run, ARGV[i], ARGV[i + 2])
  end
  redis.call('ZADD', calls, int(now + call_ttl), call)
  expire(run, calls, idle)
  return {1}
end

local function settle()
  local settled = 0
  local a = 3
  for i = 1, #KEYS, 2 do
    local run, calls = KEYS[i], KEYS[i + 1]
    local call, idle, n = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
    local measures = a + 3
    a = measures + 3 * n
    if redis.call('TYPE', calls).ok == 'zset' and redis.call('TYPE', run).ok == 'hash'
        and redis.call('ZREM', calls, call) == 1 then
      for j = measures, measures + 3 * (n - 1), 3 do
        local delta = tonumber(ARGV[j + 2]) - tonumber(ARGV[j + 1])
        if delta ~= 0 and redis.call('HINCRBY', run, ARGV[j], delta) < 0 then
          redis.call('HSET', run, ARGV[j], 0)
        end
      end
      redis.call('ZREMRANGEBYSCORE', calls, '-inf', int(now))
      expire(run, calls, idle)
      settled = settled + 1
    end
  end
  return settled
end

if ARGV[1] == 'reserve' then
  return reserve()
end
return settle()
