-- bench/ops.lua — op throughput on this machine, side by side with the
-- direct library call where there is one.
--
--   ./titan bench/ops.lua            (OMP_NUM_THREADS sets the thread count)
--
-- matmul: GFLOP/s through the engine (titan op: validation, dispatch and a
-- fresh output from the caching allocator, as a model uses it) next to
-- cblas_sgemm called directly on the same library with preallocated
-- buffers; the ratio is the engine's overhead. Attention: forward+backward
-- GFLOP/s of the fused causal kernel, and its fraction of the 2048^3 sgemm
-- rate. RMSNorm, SwiGLU, cross-entropy and AdamW: GB/s of the bytes each
-- must move (SwiGLU and cross-entropy also take an exp per element).
package.path = "./bench/?.lua;" .. package.path
local titan = require("titan")
local common = require("common")
local ffi, C = titan.ffi, titan.C
local F, ops = titan.F, titan.ops

local info = titan.blas_info()
print(("titan %s | threads %d | %s"):format(titan.version(), titan.num_threads(), info))

-- The BLAS the engine loaded (same path: dlopen hands back the same
-- library, so the same core type).
local blas_path = info:match(" from (%S+)$")
ffi.cdef([[
void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc);
]])
local blas = ffi.load(blas_path)

local function gemm_row(label, M, N, K, reps)
  return titan.scope(function()
    local a = titan.randn({ M, K }, { seed = 1 })
    local w = titan.randn({ N, K }, { seed = 2 }) -- a linear layer's weight, used as w^T
    local out = titan.empty({ M, N })
    local pa, pw, po = ffi.cast("float*", C.tt_tensor_data(a._c)), ffi.cast("float*", C.tt_tensor_data(w._c)),
        ffi.cast("float*", C.tt_tensor_data(out._c))
    local flops = 2 * M * N * K
    -- Interleaved rounds, best of each: both sides see the same machine state.
    local t_direct, t_engine = math.huge, math.huge
    for _ = 1, 3 do
      t_direct = math.min(t_direct, common.best_time(function()
        blas.cblas_sgemm(101, 111, 112, M, N, K, 1, pa, K, pw, K, 0, po, N)
      end, reps, 1))
      t_engine = math.min(t_engine, common.best_time(function()
        titan.scope(function() ops.raw_matmul(a, w, false, true) end)
      end, reps, 1))
    end
    return { label, ("%dx%dx%d"):format(M, N, K), ("%.1f"):format(flops / t_direct / 1e9),
      ("%.1f"):format(flops / t_engine / 1e9), ("%.3f"):format(t_engine / t_direct) }
  end)
end

print("\n## matmul (f32): y = x @ W^T")
local rows = {}
rows[#rows + 1] = gemm_row("square", 2048, 2048, 2048, 5)
local peak_gflops = tonumber(rows[1][3])
-- Llama 3 debug model: dim 256, ffn 768, vocab 2048, T = 2048
rows[#rows + 1] = gemm_row("debug qkvo", 2048, 256, 256, 20)
rows[#rows + 1] = gemm_row("debug ffn up", 2048, 768, 256, 20)
rows[#rows + 1] = gemm_row("debug ffn down", 2048, 256, 768, 20)
rows[#rows + 1] = gemm_row("debug output", 2048, 2048, 256, 10)
-- 125M-class: dim 768, ffn 2048, vocab 32000, T = 1024
rows[#rows + 1] = gemm_row("125M qkvo", 1024, 768, 768, 10)
rows[#rows + 1] = gemm_row("125M ffn up", 1024, 2048, 768, 10)
rows[#rows + 1] = gemm_row("125M ffn down", 1024, 768, 2048, 10)
rows[#rows + 1] = gemm_row("125M output", 1024, 32000, 768, 3)
common.print_table({ "shape", "MxNxK", "cblas GFLOP/s", "titan GFLOP/s", "time ratio titan/cblas" }, rows)

print("\n## attention (f32, causal): forward + backward")
local function attention_row(label, B, T, H, D)
  return titan.scope(function()
    local q = titan.randn({ B, T, H, D }, { seed = 1 }):requires_grad_()
    local k = titan.randn({ B, T, H, D }, { seed = 2 }):requires_grad_()
    local v = titan.randn({ B, T, H, D }, { seed = 3 }):requires_grad_()
    local dout = titan.randn({ B, T, H, D }, { seed = 4 })
    local fwd_flops = 4 * B * H * T * T * D / 2 -- QK^T and PV, causal half
    local t_fwd = common.best_time(function()
      titan.no_grad(function() titan.scope(function() F.attention(q, k, v) end) end)
    end, 5, 1)
    local t_all = common.best_time(function()
      titan.scope(function()
        local o = F.attention(q, k, v)
        o:backward(dout)
        q.grad:free(); k.grad:free(); v.grad:free()
        q.grad, k.grad, v.grad = nil, nil, nil
      end)
    end, 5, 1)
    local all_flops = fwd_flops * 3.5 -- backward = 2.5x forward
    return { label, ("B%d T%d H%d D%d"):format(B, T, H, D), ("%.1f"):format(fwd_flops / t_fwd / 1e9),
      ("%.1f"):format(all_flops / t_all / 1e9), ("%.0f%%"):format(100 * all_flops / t_all / 1e9 / peak_gflops) }
  end)
end
common.print_table({ "model", "shape", "fwd GFLOP/s", "fwd+bwd GFLOP/s", "fwd+bwd / sgemm 2048^3" }, {
  attention_row("debug", 1, 2048, 16, 16),
  attention_row("125M", 1, 1024, 12, 64),
  attention_row("125M @ T=2048", 1, 2048, 12, 64),
})

print("\n## memory-bound kernels (f32)")
local function norm_row(label, rows_, dim)
  return titan.scope(function()
    local x = titan.randn({ rows_, dim }, { seed = 1 })
    local w = titan.ones(dim)
    local dy = titan.randn({ rows_, dim }, { seed = 2 })
    local y, rstd
    local t_f = common.best_time(function()
      titan.scope(function() F.rms_norm(x, w) end)
    end, 10, 2)
    local outp, outp2 = ffi.new("tt_tensor*[1]"), ffi.new("tt_tensor*[1]")
    C.tt_op_rmsnorm(x._c, w._c, 1e-6, outp, outp2)
    y, rstd = outp[0], outp2[0]
    local dw = titan.zeros(dim)
    local t_b = common.best_time(function()
      local dx = ffi.new("tt_tensor*[1]")
      assert(C.tt_op_rmsnorm_backward(x._c, w._c, rstd, dy._c, dx, dw._c) == 0)
      C.tt_tensor_release(dx[0])
    end, 10, 2)
    C.tt_tensor_release(y)
    C.tt_tensor_release(rstd)
    local bytes = rows_ * dim * 4
    return { label, ("%dx%d"):format(rows_, dim), ("%.1f"):format(2 * bytes / t_f / 1e9),
      ("%.1f"):format(3 * bytes / t_b / 1e9) }
  end)
end
common.print_table({ "rmsnorm", "rows x dim", "fwd GB/s (read x, write y)", "bwd GB/s (read x, dy; write dx)" }, {
  norm_row("debug", 2048, 256),
  norm_row("125M", 1024, 768),
})

-- SwiGLU over the FFN hidden activations: forward reads a, b and writes y;
-- backward reads a, b, dy and writes da, db.
local function swiglu_row(label, n)
  return titan.scope(function()
    local a = titan.randn({ n }, { seed = 1 })
    local b = titan.randn({ n }, { seed = 2 })
    local dy = titan.randn({ n }, { seed = 3 })
    local t_f = common.best_time(function()
      titan.scope(function() F.swiglu(a, b) end)
    end, 10, 2)
    local t_b = common.best_time(function()
      local da, db = ffi.new("tt_tensor*[1]"), ffi.new("tt_tensor*[1]")
      assert(C.tt_op_swiglu_backward(a._c, b._c, dy._c, da, db) == 0)
      C.tt_tensor_release(da[0])
      C.tt_tensor_release(db[0])
    end, 10, 2)
    return { label, tostring(n), ("%.1f"):format(3 * 4 * n / t_f / 1e9), ("%.1f"):format(5 * 4 * n / t_b / 1e9) }
  end)
end
common.print_table({ "swiglu", "elements", "fwd GB/s (3 x 4 bytes)", "bwd GB/s (5 x 4 bytes)" }, {
  swiglu_row("debug 8x512 tokens", 8 * 512 * 768),
  swiglu_row("125M 2x1024 tokens", 2 * 1024 * 2048),
})

-- Cross-entropy over the vocabulary: forward reads the logits twice (max,
-- then the sum of exps: counted once here), backward reads them and writes
-- dlogits.
local function xent_row(label, N, V)
  return titan.scope(function()
    local logits = titan.randn({ N, V }, { seed = 1 })
    local tv = {}
    for i = 1, N do tv[i] = (i * 7919) % V end
    local targets = titan.tensor(tv, { dtype = "int64" })
    local losses, lse = ffi.new("tt_tensor*[1]"), ffi.new("tt_tensor*[1]")
    assert(C.tt_op_cross_entropy(logits._c, targets._c, -100, losses, lse, nil) == 0)
    local dl = titan.full({ N }, 1 / N)
    local t_f = common.best_time(function()
      local l2, s2 = ffi.new("tt_tensor*[1]"), ffi.new("tt_tensor*[1]")
      assert(C.tt_op_cross_entropy(logits._c, targets._c, -100, l2, s2, nil) == 0)
      C.tt_tensor_release(l2[0])
      C.tt_tensor_release(s2[0])
    end, 10, 2)
    local t_b = common.best_time(function()
      local dx = ffi.new("tt_tensor*[1]")
      assert(C.tt_op_cross_entropy_backward(logits._c, targets._c, lse[0], dl._c, -100, dx) == 0)
      C.tt_tensor_release(dx[0])
    end, 10, 2)
    C.tt_tensor_release(losses[0])
    C.tt_tensor_release(lse[0])
    local bytes = N * V * 4
    return { label, ("%dx%d"):format(N, V), ("%.1f"):format(bytes / t_f / 1e9), ("%.1f"):format(2 * bytes / t_b / 1e9) }
  end)
end
common.print_table({ "cross-entropy", "rows x vocab", "fwd GB/s (read logits)", "bwd GB/s (read, write dlogits)" }, {
  xent_row("debug", 2048, 2048),
  xent_row("125M", 1024, 32000),
})

local function adamw_row(label, n)
  return titan.scope(function()
    local p = titan.randn({ n }, { seed = 1 })
    local g = titan.randn({ n }, { seed = 2 })
    local m, v = titan.zeros(n), titan.zeros(n)
    local step = 0
    local t = common.best_time(function()
      step = step + 1
      assert(C.tt_op_adamw(p._c, g._c, m._c, v._c, nil, 1e-3, 0.9, 0.95, 1e-8, 0.1, step) == 0)
    end, 10, 2)
    -- read p, g, m, v; write p, m, v
    return { label, tostring(n), ("%.1f"):format(7 * 4 * n / t / 1e9) }
  end)
end
common.print_table({ "adamw", "elements", "GB/s (7 x 4 bytes per element)" }, {
  adamw_row("debug model params", 6 * (4 * 256 * 256 + 3 * 256 * 768) + 2 * 2048 * 256),
  adamw_row("125M-class params", 12 * (4 * 768 * 768 + 3 * 768 * 2048) + 2 * 32000 * 768),
})
