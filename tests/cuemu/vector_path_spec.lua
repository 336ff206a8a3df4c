-- vector_path_spec.lua — a training step's fused kernels move their data in
-- 16-byte accesses, and the step makes no separate pass to sum gradients
-- (cuemu's per-kernel counts; run by ctest as cuemu/vector_path_spec,
-- skipped anywhere else).
--
-- The fused kernels (RMSNorm, RoPE, SwiGLU, cross-entropy, AdamW, the
-- gradient norm, the embedding lookup, and the elementwise ops) read and write
-- their rows in 16-byte chunks, with one vector access per chunk when the
-- row starts 16-byte aligned and element by element otherwise. Both give the
-- same bits, so only the speed tells them apart: the element path issues 2
-- to 16 times as many memory instructions and falls well short of HBM
-- bandwidth, which a GPU benchmark would show and no correctness spec can.
-- cuemu counts, per kernel, the full chunks taken each way (the vector
-- helpers' TT_EMU_CHUNK, kernels/cuda/cuda_common.h). These are counts,
-- not timings.
local ffi = require("ffi")
package.path = "./tests/cuda/?.lua;./tests/cuemu/?.lua;" .. package.path
local S = require("step_helpers")
S.require_cuemu([[
struct tt_emu_chunk_count { const char *kernel; uint64_t launches, vector, split; };
int tt_emu_chunks_get(struct tt_emu_chunk_count *out, int max);
void tt_emu_chunks_reset(void);
]], "tt_emu_chunks_get")
local H = require("helpers")
local F = require("titan.functional")
pcall(ffi.cdef, "int setenv(const char *name, const char *value, int overwrite); int unsetenv(const char *name);")

-- kernel name -> { launches, vector, split } since the last reset
local function chunks()
  local buf = ffi.new("struct tt_emu_chunk_count[512]")
  local n = ffi.C.tt_emu_chunks_get(buf, 512)
  assert(n <= 512, "more kernels than the buffer holds")
  local t = {}
  for i = 0, n - 1 do
    local c = buf[i]
    t[ffi.string(c.kernel)] = { launches = tonumber(c.launches), vector = tonumber(c.vector),
      split = tonumber(c.split) }
  end
  return t
end

local function show(what, t)
  local names = {}
  for k in pairs(t) do names[#names + 1] = k end
  table.sort(names)
  io.stderr:write(("\n  %s:\n"):format(what))
  for _, k in ipairs(names) do
    local c = t[k]
    io.stderr:write(("    %-44s %4d launches %10d vector %8d split\n"):format(k, c.launches, c.vector, c.split))
  end
end

local function find(t, prefix)
  for k, c in pairs(t) do
    if k:sub(1, #prefix) == prefix then return c end
  end
end

-- One steady-state step of the debug model, counted.
local function step_chunks(extra)
  local tr = S.debug_trainer(extra)
  tr:train(2)
  H.sync()
  ffi.C.tt_emu_chunks_reset()
  tr:train(3)
  H.sync()
  local t = chunks()
  S.close(tr, H)
  return t
end

describe("the fused kernels' 16-byte accesses (cuemu's chunk counts)", function()
  -- The kernels each step must run through the vector helpers: a rename or
  -- a kernel that stops using them fails here rather than going unchecked.
  local FUSED = { "tt_rmsnorm_kernel", "tt_rmsnorm_dx_kernel", "tt_rope_kernel", "tt_swiglu_kernel",
    "tt_swiglu_backward_kernel", "tt_ce_forward", "tt_ce_backward", "tt_adamw_mt_kernel", "tt_sumsq_partial",
    "tt_index_select_kernel" }

  for _, case in ipairs({
    { "f32", {} },
    -- bf16 activations: the lean kernels of RMSNorm, SwiGLU, cross-entropy and RoPE (docs/cuda.md)
    { "bf16 params + f32 master", { "--training.mixed_precision_param=bfloat16" }, lean = true },
    -- two micro-batches: the second one's weight gradients add into .grad inside the GEMMs too
    { "2 micro-batches", { "--training.global_batch_tokens=128" } },
    -- bf16 with the exact kernels (TITAN_CUDA_NORM_PLAN, _SWIGLU_PLAN, _CE_PLAN, _ROPE_PLAN = exact)
    { "bf16, the exact plans", { "--training.mixed_precision_param=bfloat16" }, exact = true },
  }) do
    it("a training step, " .. case[1] .. ": every full chunk in one vector access", function()
      local PLANS = { "TITAN_CUDA_NORM_PLAN", "TITAN_CUDA_SWIGLU_PLAN", "TITAN_CUDA_CE_PLAN", "TITAN_CUDA_ROPE_PLAN" }
      for _, var in ipairs(PLANS) do
        if case.exact then ffi.C.setenv(var, "exact", 1) end
      end
      local fine, t = pcall(step_chunks, case[2])
      for _, var in ipairs(PLANS) do ffi.C.unsetenv(var) end
      if not fine then error(t, 0) end
      show("one step, " .. case[1], t)
      for k, c in pairs(t) do
        assert.are.equal(0, c.split, k .. ": full chunks split into element accesses")
      end
      local LEAN_NAMES = { tt_rmsnorm_kernel = "tt_rmsnorm_lean_kernel",
        tt_rmsnorm_dx_kernel = "tt_rmsnorm_dxdw_lean_kernel", tt_swiglu_kernel = "tt_swiglu_lean_kernel",
        tt_swiglu_backward_kernel = "tt_swiglu_backward_lean_kernel", tt_ce_forward = "tt_ce_forward_lean",
        tt_ce_backward = "tt_ce_backward_lean", tt_rope_kernel = "tt_rope_lean_kernel" }
      for _, k in ipairs(FUSED) do
        if case.lean then k = LEAN_NAMES[k] or k end
        local c = find(t, k .. "<") or t[k]
        assert.truthy(c, k .. " ran in the step")
        assert.truthy(c.vector > 0, k .. " took the vector path")
      end
      if case.exact then
        for k in pairs(t) do assert.is_nil(k:find("_lean"), k .. " ran with every plan at exact") end
      end
      -- Nor a pass of its own to sum an activation's gradients: the normed
      -- input of q, k and v and of SwiGLU's gate and up takes its second
      -- and later parts inside the GEMM (beta = 1), the residual stream
      -- inside the RMSNorm backward.
      assert.is_nil(find(t, "tt_axpy_kernel"), "a separate gradient add (axpy) in the step")
    end)
  end

  -- The counts can fail: the same norm over rows that start off a 16-byte
  -- boundary takes the element path (the exact kernel: the lean ones take
  -- aligned rows only), and the counts say so (the view's tensors go with
  -- the scope).
  it("sees the element path: an RMSNorm over rows 2 bytes off alignment splits its chunks", H.scoped(function()
    local rows, dim = 8, 64
    local flat = H.randn({ rows * dim + 8 }, 7, "bfloat16"):to("cuda")
    local w = H.randn({ dim }, 8, "bfloat16"):to("cuda")
    local function norm_from(start, kernel)
      local x = flat:narrow(1, start, rows * dim):view(rows, dim)
      ffi.C.tt_emu_chunks_reset()
      local y = F.rms_norm(x, w, 1e-5)
      H.sync()
      return find(chunks(), kernel .. "<")
    end
    -- 8 bf16 = 16 bytes; 1 = 2 bytes
    local aligned, off = norm_from(1 + 8, "tt_rmsnorm_lean_kernel"), norm_from(1 + 1, "tt_rmsnorm_kernel")
    assert.truthy(aligned, "tt_rmsnorm_lean_kernel ran on the aligned rows")
    assert.truthy(off, "tt_rmsnorm_kernel ran on the misaligned rows")
    assert.are.equal(0, aligned.split, "aligned rows: split chunks")
    assert.truthy(aligned.vector > 0, "aligned rows: vector accesses")
    assert.truthy(off.split > 0, "misaligned rows: split chunks counted")
    assert.are.equal(0, off.vector, "misaligned rows: vector accesses")
  end))
end)
