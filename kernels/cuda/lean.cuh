/*
 * lean.cuh — what the lean kernels share: bf16 pairs in 32-bit words, the
 * hardware's bf16 rounding, its approximate exp2 and reciprocal, and the
 * settings that turn each family's lean kernels off.
 *
 * The default kernels compute as the CPU reference does (kernels/cpu), so f32
 * results are bit-identical to it and bf16 ones differ only by the order of
 * a sum. For bf16 tensors of whole 16-byte chunks the RMSNorm, SwiGLU,
 * cross-entropy and RoPE families also have lean kernels: f32 math with the
 * hardware's instructions where the CPU-matching code takes many (bf16
 * rounding in one cvt.rn.bf16x2.f32 rather than seven integer instructions,
 * exp2 in one ex2.approx rather than the ported polynomial, a reciprocal in
 * rcp.approx rather than an IEEE division). The approximations are a few
 * ulps of f32 (CUDA's exp2f: 2 ulps; __fdividef: 2 ulps over the range used
 * here), far under bf16's half ulp, so results stay within the reference's
 * bf16 tolerance; they are not its bits. DESIGN.md asks for norms'
 * statistics, softmax and the loss in fp32: they are.
 *
 * TITAN_CUDA_NORM_PLAN, TITAN_CUDA_SWIGLU_PLAN, TITAN_CUDA_CE_PLAN and
 * TITAN_CUDA_ROPE_PLAN = exact turn a family's lean kernels off (lean, the
 * default, or unset keeps them), read at each launch so the GPU benchmark
 * can time both side by side.
 */
#ifndef TT_KERNELS_CUDA_LEAN_CUH
#define TT_KERNELS_CUDA_LEAN_CUH

#include <stdlib.h>
#include <string.h>

#include <cuda_bf16.h>

#include "kernel_util.cuh"

/* Two floats rounded to bf16 in one instruction, NaN encoded as the host
 * converter does (the hardware gives 0x7fff for every NaN). */
__device__ __forceinline__ uint32_t tt_bf16x2_rn(float lo, float hi) {
  const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &p, sizeof u);
  if (lo != lo || hi != hi) u = (uint32_t)tt_d_f32_to_bf16(lo) | (uint32_t)tt_d_f32_to_bf16(hi) << 16;
  return u;
}
__device__ __forceinline__ float tt_bf16_lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float tt_bf16_hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }

/* 2^x: one ex2.approx on the GPU (CUDA's exp2f, 2 ulps; 0 for x below
 * -150, inf above 128, NaN for NaN). */
__device__ __forceinline__ float tt_lean_exp2(float x) { return exp2f(x); }

/* 1 / d for d in [1, 2] (rcp.approx and a multiply); cuemu has no
 * __fdividef and divides. */
__device__ __forceinline__ float tt_lean_rcp12(float d) {
#if defined(TITAN_CUEMU)
  return 1.0f / d;
#else
  return __fdividef(1.0f, d);
#endif
}

#define TT_LOG2E 1.4426950408889634f

/* sigmoid(a) from e = 2^(-|a| log2 e) in (0, 1], which never overflows:
 * 1 / (1 + e) for a >= 0, e / (1 + e) below (the CPU's form). NaN stays
 * NaN. */
__device__ __forceinline__ float tt_lean_sigmoid(float a) {
  const float e = tt_lean_exp2(-fabsf(a) * TT_LOG2E);
  const float s = tt_lean_rcp12(1.0f + e);
  return a >= 0.0f ? s : e * s;
}

/* A family's plan setting: 0 lean (unset, empty or "lean"), 1 exact, -1
 * anything else (the caller reports it, naming the variable). */
static inline int tt_lean_setting(const char *var) {
  const char *e = getenv(var);
  if (!e || !*e || !strcmp(e, "lean")) return 0;
  return !strcmp(e, "exact") ? 1 : -1;
}

/* Whether op takes its lean kernel: TT_OK with *lean set, or the error line
 * for a bad value of var. */
static inline tt_status tt_lean_plan(const char *var, const char *op, bool *lean) {
  const int v = tt_lean_setting(var);
  if (v < 0) return tt_error_set(TT_ERR_INVALID, "cuda %s: %s=%s: expected lean or exact", op, var, getenv(var));
  *lean = v == 0;
  return TT_OK;
}

#endif
