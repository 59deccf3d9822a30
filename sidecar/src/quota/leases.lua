-- One renewal of fleet-wide leases, atomic over all its asks (see quota/store.rs).
--
-- KEYS[i]: the i-th counter's stored name (prefix, counter name, window kind).
-- ARGV[1]: "" to read the store's clock (TIME), or a Unix ms time (tests of window boundaries).
-- ARGV[2], ARGV[3]: the calling Envoy's holder id ("" when it sends none) and how long its
-- holdings stand without another call from it.
-- ARGV[3 + 7(i-1) + 1..7]: the i-th ask's window, limit, want, returned, returned window start
-- ("" when none), what the caller holds unspent of a window ("" when it does not say), and the
-- start of the window that holding is of.
-- Returns four integers per ask: granted, remaining, resets_ms, window start (-1: a bucket).
--
-- A window's holdings live beside its count (key ':held', a hash of holder id to
-- "held:seen_ms:hold_ms"): the holding of an Envoy not heard from within its hold goes back to
-- the budget. (One cut off from the store that long and still spending it overshoots by as much:
-- the bound of a store outage.)
--
-- Every value read is clamped to [0, limit]; a value that is not a number, or a key of another
-- type, counts as missing: a store restarted empty, or holding junk, never yields a negative or
-- unbounded grant.

if redis.replicate_commands then
  -- Redis before 5: replicate the writes, not the script (it reads TIME).
  redis.replicate_commands()
end

local floor = math.floor
local MINUTE = 60000
local HOUR = 3600000
local DAY = 86400000
-- Old windows' keys vanish this long after their window ends; a full bucket's after it filled.
local MARGIN = 60000

local now = tonumber(ARGV[1])
local holder = ARGV[2]
local hold = tonumber(ARGV[3]) or 0
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + floor(tonumber(t[2]) / 1000)
end

local function num(x)
  return string.format('%.17g', x)
end

local function clamp(x, hi)
  if x == nil or x ~= x then return nil end
  if x < 0 then return 0 end
  if x > hi then return hi end
  return x
end

-- Howard Hinnant's civil-date algorithms, as core::fleet has them.
local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = floor(y / 400)
  local yoe = y - era * 400
  local mp = (m + 9) % 12
  local doy = floor((153 * mp + 2) / 5) + d - 1
  local doe = yoe * 365 + floor(yoe / 4) - floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end

local function civil_from_days(days)
  local z = days + 719468
  local era = floor(z / 146097)
  local doe = z - era * 146097
  local yoe = floor((doe - floor(doe / 1460) + floor(doe / 36524) - floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + floor(yoe / 4) - floor(yoe / 100))
  local mp = floor((5 * doy + 2) / 153)
  local month = mp < 10 and mp + 3 or mp - 9
  local year = yoe + era * 400
  if month <= 2 then year = year + 1 end
  return year, month
end

-- The UTC calendar window holding `now`, as [start, stop).
local function bounds(kind)
  if kind == 'hour' then
    local start = now - now % HOUR
    return start, start + HOUR
  elseif kind == 'day' then
    local start = now - now % DAY
    return start, start + DAY
  end
  local y, m = civil_from_days(floor(now / DAY))
  local ny, nm = y, m + 1
  if m == 12 then ny, nm = y + 1, 1 end
  return days_from_civil(y, m, 1) * DAY, days_from_civil(ny, nm, 1) * DAY
end

-- A read; a key of the wrong type is junk and is dropped (nil: missing).
local function read(cmd, key, ...)
  local v = redis.pcall(cmd, key, ...)
  if type(v) == 'table' and v.err then
    redis.call('DEL', key)
    return nil
  end
  return v
end

-- A token bucket of capacity `limit`, refilled limit/60 s continuously; missing: full.
local function bucket(key, limit, want, returned)
  local v = read('HMGET', key, 'level', 'updated_ms')
  local level, updated
  if v then
    level = clamp(tonumber(v[1]), limit)
    updated = tonumber(v[2])
  end
  if level == nil then
    level = limit
    updated = now
  end
  if updated == nil or updated ~= updated or updated > now then updated = now end
  local full_in = 0
  if limit > 0 then
    level = math.min(limit, level + (now - updated) * limit / MINUTE)
    level = math.min(limit, level + returned)
  end
  local granted = math.min(want, floor(level))
  level = level - granted
  if limit > 0 then full_in = math.ceil((limit - level) * MINUTE / limit) end
  redis.call('HSET', key, 'level', num(level), 'updated_ms', num(now))
  redis.call('PEXPIRE', key, full_in + MARGIN)
  return granted, floor(level), now + full_in, -1
end

-- The window's count `used` once the holdings of other Envoys gone quiet are back in it.
local function reclaim(hk, used)
  local all = read('HGETALL', hk) or {}
  for j = 1, #all, 2 do
    local id = all[j]
    local h, seen, ttl = string.match(all[j + 1], '^([^:]+):([^:]+):([^:]+)$')
    h, seen, ttl = tonumber(h), tonumber(seen), tonumber(ttl)
    if h == nil or seen == nil or ttl == nil then
      redis.call('HDEL', hk, id)
    elseif id ~= holder and seen + ttl < now then
      used = math.max(0, used - h)
      redis.call('HDEL', hk, id)
    end
  end
  return used
end

-- What was granted in the current calendar window, under a key of that window; missing: 0.
local function window(key, kind, limit, want, returned, returned_start, held, held_start)
  local start, stop = bounds(kind)
  local k = key .. ':' .. num(start)
  local hk = k .. ':held'
  local used = clamp(tonumber(read('GET', k)), limit) or 0
  local holds = holder ~= '' and held ~= nil
  if holds then used = reclaim(hk, used) end
  if returned > 0 and returned_start == start then used = math.max(0, used - returned) end
  -- A holding of a window that has ended is not one of this window's.
  if holds and held_start ~= start then held = 0 end
  local granted = math.max(0, math.min(want, limit - used))
  used = used + granted
  redis.call('SET', k, num(used))
  redis.call('PEXPIREAT', k, stop + MARGIN)
  if holds then
    redis.call('HSET', hk, holder, num(held + granted) .. ':' .. num(now) .. ':' .. num(hold))
    redis.call('PEXPIREAT', hk, stop + MARGIN)
  end
  return granted, limit - used, stop, start
end

local out = {}
for i, key in ipairs(KEYS) do
  local a = 3 + (i - 1) * 7
  local kind = ARGV[a + 1]
  local limit = tonumber(ARGV[a + 2])
  local want = tonumber(ARGV[a + 3])
  local returned = tonumber(ARGV[a + 4])
  local g, r, resets, start
  if kind == 'minute' then
    g, r, resets, start = bucket(key, limit, want, returned)
  else
    g, r, resets, start = window(key, kind, limit, want, returned, tonumber(ARGV[a + 5]),
      tonumber(ARGV[a + 6]), tonumber(ARGV[a + 7]))
  end
  out[#out + 1] = g
  out[#out + 1] = r
  out[#out + 1] = resets
  out[#out + 1] = start
end
return out
