-- data/random.lua — counter-based randomness for data order.
--
-- Every value is a pure function of (seed, stream, counter): the data order
-- at any position can be recomputed after a restart, so a loader's state is
-- a few integers, never a generator's internals.
local bit = require("bit")
local ffi = require("ffi")

local M = {}

local u64 = ffi.typeof("uint64_t")

-- splitmix64's finalizer: a fast 64-bit mixer with good avalanche.
local function mix(z)
  z = z + 0x9E3779B97F4A7C15ULL
  z = bit.bxor(z, bit.rshift(z, 30)) * 0xBF58476D1CE4E5B9ULL
  z = bit.bxor(z, bit.rshift(z, 27)) * 0x94D049BB133111EBULL
  return bit.bxor(z, bit.rshift(z, 31))
end

-- hash(a[, b[, c]]) -> uint64 cdata; arguments are non-negative integers.
function M.hash(a, b, c)
  local h = mix(u64(a))
  if b then h = mix(bit.bxor(h, u64(b))) end
  if c then h = mix(bit.bxor(h, u64(c))) end
  return h
end

-- uniform(seed, stream, counter) -> a number in [0, 1).
function M.uniform(seed, stream, counter)
  return tonumber(bit.rshift(M.hash(seed, stream, counter), 11)) / 9007199254740992
end

local ROUNDS = 6

-- permutation(n, seed, epoch) -> perm(i), a bijection of [0, n) onto itself.
--
-- A Feistel network on the smallest even-bit power-of-two domain that holds
-- n, with cycle walking back into [0, n): O(1) memory and O(1) per lookup,
-- so shuffling billions of windows costs nothing up front and resuming at
-- position k needs only k.
function M.permutation(n, seed, epoch)
  if n <= 1 then return function(i) return i end end
  local bits = 1
  while 2 ^ bits < n do bits = bits + 1 end
  local h = math.ceil(bits / 2)
  if h > 26 then error("permutation: " .. n .. " items is more than this shuffle supports (2^52)", 2) end
  local half = 2 ^ h
  local mask = u64(half - 1)
  local keys = {}
  for r = 1, ROUNDS do keys[r] = M.hash(seed, epoch, r) end
  local function encrypt(x)
    local l, r = math.floor(x / half), x % half
    for k = 1, ROUNDS do
      local f = tonumber(bit.band(mix(bit.bxor(keys[k], u64(r))), mask))
      l, r = r, bit.bxor(l, f)
    end
    return l * half + r
  end
  return function(i)
    local x = encrypt(i)
    while x >= n do x = encrypt(x) end
    return x
  end
end

return M
