-- Settles a batch of calls of runs, atomically (see quota/runs.rs).
--
-- KEYS[2i-1], KEYS[2i]: the i-th call's run hash and calls in flight (as runs_reserve.lua).
-- ARGV[1]: "" to read the store's clock, or a Unix ms time (tests). Then per call: its id, the
-- run's idle ttl, the number of measures, and per measure: name, reserved, used.
-- Returns the number of calls settled.
--
-- A call is settled once, and only while it is among its run's calls in flight: a settle that
-- comes after the call's entry lapsed, after the run ended, or before the call was reserved,
-- changes nothing (what the call reserved stays charged: never an overshoot).

if redis.replicate_commands then
  redis.replicate_commands()
end

local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local settled = 0
local a = 2
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
    redis.call('ZREMRANGEBYSCORE', calls, '-inf', string.format('%d', now))
    local last = redis.call('ZRANGE', calls, -1, -1, 'WITHSCORES')
    local until_ms = math.max(now, tonumber(last[2]) or now)
    redis.call('PEXPIRE', run, string.format('%d', until_ms - now + idle))
    redis.call('PEXPIRE', calls, string.format('%d', until_ms - now + idle))
    settled = settled + 1
  end
end
return settled
