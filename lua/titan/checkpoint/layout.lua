-- checkpoint/layout.lua — the reshard math: boxes (global offsets + sizes,
-- 0-based), torch.chunk splits, which stored chunks overlap a wanted box and
-- where each overlap lies in the chunk and in the destination. Pure Lua over
-- a handful of numbers per chunk: the bytes are C's (tt_ckpt_read).
local M = {}

-- torch.chunk / DTensor Shard(dim) on n items over k parts: parts of
-- ceil(n / k), the last smaller, trailing parts empty when n < k.
-- Returns the 0-based start and the length of part i (0-based). The rule
-- is the placement math's (engine/dtensor.c), not a copy of it.
local tffi = require("titan.ffi")
local ffi, C = tffi.ffi, tffi.C
local c_n, c_k, c_i, c_pl, c_box = ffi.new("int64_t[1]"), ffi.new("int[1]"), ffi.new("int[1]"),
  ffi.new("tt_placement[1]"), ffi.new("tt_box")
c_pl[0].kind, c_pl[0].dim = C.TT_PLACE_SHARD, 0
function M.chunk(n, k, i)
  assert(k >= 1 and i >= 0 and i < k, "layout.chunk: part index out of range")
  c_n[0], c_k[0], c_i[0] = n, k, i
  tffi.check(C.tt_dtensor_local_box(1, c_n, 1, c_k, c_i, c_pl, nil, c_box), 2)
  return tonumber(c_box.offset[0]), tonumber(c_box.shape[0])
end

-- The box of part i of k when `shape` is split along dim (1-based).
function M.shard_box(shape, dim, k, i)
  local offset, size = {}, {}
  for d = 1, #shape do
    offset[d], size[d] = 0, shape[d]
  end
  offset[dim], size[dim] = M.chunk(shape[dim], k, i)
  return offset, size
end

-- Boxes of a grid split: splits = { [dim] = parts, ... }; parts numbered in
-- row-major order of the grid. Returns a list of { offset, size }.
function M.grid_boxes(shape, splits)
  local dims, boxes = {}, { { offset = {}, size = {} } }
  for d = 1, #shape do
    boxes[1].offset[d], boxes[1].size[d] = 0, shape[d]
    if splits[d] and splits[d] > 1 then dims[#dims + 1] = d end
  end
  for _, d in ipairs(dims) do
    local out = {}
    for _, b in ipairs(boxes) do
      for i = 0, splits[d] - 1 do
        local o, s = {}, {}
        for j = 1, #shape do o[j], s[j] = b.offset[j], b.size[j] end
        o[d], s[d] = M.chunk(shape[d], splits[d], i)
        out[#out + 1] = { offset = o, size = s }
      end
    end
    boxes = out
  end
  return boxes
end

function M.volume(size)
  local v = 1
  for d = 1, #size do v = v * size[d] end
  return v
end

-- Intersection of two boxes: offset, size, or nil when empty.
function M.intersect(ao, as, bo, bs)
  local o, s = {}, {}
  for d = 1, #ao do
    local lo = math.max(ao[d], bo[d])
    local hi = math.min(ao[d] + as[d], bo[d] + bs[d])
    if hi <= lo then return nil end
    o[d], s[d] = lo, hi - lo
  end
  return o, s
end

function M.same_box(ao, as, bo, bs)
  for d = 1, #ao do
    if ao[d] ~= bo[d] or as[d] ~= bs[d] then return false end
  end
  return true
end

-- Is box (o, s) inside `shape`?
function M.inside(o, s, shape)
  if #o ~= #shape or #s ~= #shape then return false end
  for d = 1, #shape do
    if o[d] < 0 or s[d] < 0 or o[d] + s[d] > shape[d] then return false end
  end
  return true
end

-- For a wanted box (offset, size) and stored chunks ({offset, size, ...}),
-- the reads: { chunk = c, start = box in chunk coords, dst = box in the
-- wanted tensor's coords, count = sizes, whole = the read covers the
-- chunk }. `covered` is the volume the reads add up to: equal to the wanted
-- volume when the chunks tile it (more means chunks overlap each other,
-- less means part of it was never stored).
function M.plan_reads(chunks, want_offset, want_size)
  local reads, covered = {}, 0
  for _, c in ipairs(chunks) do
    local o, s = M.intersect(c.offset, c.size, want_offset, want_size)
    if o then
      local start, dst = {}, {}
      for d = 1, #o do
        start[d] = o[d] - c.offset[d]
        dst[d] = o[d] - want_offset[d]
      end
      reads[#reads + 1] = { chunk = c, start = start, dst = dst, count = s, whole = M.same_box(o, s, c.offset, c.size) }
      covered = covered + M.volume(s)
    end
  end
  if #want_size == 0 then -- a scalar: one chunk, no dims
    reads, covered = {}, 0
    for _, c in ipairs(chunks) do
      reads[1] = { chunk = c, start = {}, dst = {}, count = {}, whole = true }
      covered = 1
      break
    end
  end
  return reads, covered
end

-- Save planning across ranks: ranks[r] = list of items {name, offset, size};
-- a box held by several ranks (a replicated tensor) is written by the
-- lowest rank only. Returns keep[r][i] = true for the items rank r writes.
function M.dedup(ranks)
  local seen, keep = {}, {}
  for r = 1, #ranks do
    keep[r] = {}
    for i, it in ipairs(ranks[r]) do
      local key = it.name .. "@" .. table.concat(it.offset, ",") .. "+" .. table.concat(it.size, ",")
      if not seen[key] then
        seen[key] = true
        keep[r][i] = true
      end
    end
  end
  return keep
end

return M
