/*
 * dtype.cuh — element loads and stores with conversion, in device code.
 *
 * The conversions give the same bits as kernels/dtype_conv.h on the host
 * (round-to-nearest-even, the same NaN encodings, fp8 saturation), so CUDA
 * results can be compared with the CPU reference bit for bit. Integers
 * travel as int64 and floats as float (double when either side is f64):
 * float->int truncates toward zero, bool is "!= 0".
 */
#ifndef TT_KERNELS_CUDA_DTYPE_CUH
#define TT_KERNELS_CUDA_DTYPE_CUH

#include <cuda_fp16.h>
#include <stdint.h>

#include "cuda_common.h"

__device__ __forceinline__ float tt_d_bf16_to_f32(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }

__device__ __forceinline__ uint16_t tt_d_f32_to_bf16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* The hardware conversions are IEEE round-to-nearest-even; only NaN
 * encodings need to be made to match the host's. */
__device__ __forceinline__ float tt_d_f16_to_f32(uint16_t h) {
  if ((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu))
    return __uint_as_float(((uint32_t)(h & 0x8000u) << 16) | 0x7f800000u | ((uint32_t)(h & 0x3ffu) << 13));
  return __half2float(__ushort_as_half(h));
}

__device__ __forceinline__ uint16_t tt_d_f32_to_f16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)(((u >> 16) & 0x8000u) | 0x7e00u);
  return __half_as_ushort(__float2half_rn(f));
}

__device__ __forceinline__ float tt_d_f8_to_f32(uint8_t x, int e4m3) {
  int sign = x >> 7;
  int mbits = e4m3 ? 3 : 2, ebits = e4m3 ? 4 : 5, bias = e4m3 ? 7 : 15;
  int e = (x >> mbits) & ((1 << ebits) - 1);
  int m = x & ((1 << mbits) - 1);
  float v;
  if (e4m3 && e == 15 && m == 7) return __uint_as_float(0x7fc00000u);
  if (!e4m3 && e == 31) return m ? __uint_as_float(0x7fc00000u) : __uint_as_float(sign ? 0xff800000u : 0x7f800000u);
  if (e == 0) v = ldexpf((float)m, 1 - bias - mbits);
  else v = ldexpf((float)(m | (1 << mbits)), e - bias - mbits);
  return sign ? -v : v;
}

__device__ __forceinline__ uint8_t tt_d_f32_to_f8(float f, int e4m3) {
  int mbits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
  float maxv = e4m3 ? 448.0f : 57344.0f;
  uint8_t sign = (__float_as_uint(f) >> 31) ? 0x80 : 0;
  if (isnan(f)) return 0x7f;
  float a = fabsf(f);
  if (a == 0.0f) return sign; /* frexpf(0) gives e = 0, which would encode 0.5 */
  if (a >= maxv) {
    if (!e4m3 && isinf(a)) return sign | 0x7c;
    return sign | (e4m3 ? 0x7e : 0x7b);
  }
  int e;
  frexpf(a, &e);
  int exp_field = e - 1 + bias;
  int q;
  if (exp_field <= 0) {
    q = (int)nearbyintf(ldexpf(a, bias - 1 + mbits));
    return sign | (uint8_t)q;
  }
  q = (int)nearbyintf(ldexpf(a, mbits - (e - 1)));
  if (q >= (2 << mbits)) {
    q >>= 1;
    exp_field++;
  }
  return sign | (uint8_t)((exp_field << mbits) | (q & ((1 << mbits) - 1)));
}

__device__ __forceinline__ bool tt_d_is_int(int dt) {
  return dt == TT_I32 || dt == TT_I64 || dt == TT_U8 || dt == TT_BOOL;
}

__device__ __forceinline__ long long tt_d_load_int(int dt, const void *p, int64_t i) {
  switch (dt) {
    case TT_I32: return ((const int32_t *)p)[i];
    case TT_I64: return ((const int64_t *)p)[i];
    case TT_U8: return ((const uint8_t *)p)[i];
    default: return ((const uint8_t *)p)[i] != 0;
  }
}

/* Every float dtype but f64 is exact in float. */
template <typename F>
__device__ __forceinline__ F tt_d_load_float(int dt, const void *p, int64_t i) {
  switch (dt) {
    case TT_F32: return (F)((const float *)p)[i];
    case TT_F64: return (F)((const double *)p)[i];
    case TT_BF16: return (F)tt_d_bf16_to_f32(((const uint16_t *)p)[i]);
    case TT_F16: return (F)tt_d_f16_to_f32(((const uint16_t *)p)[i]);
    case TT_F8E4M3: return (F)tt_d_f8_to_f32(((const uint8_t *)p)[i], 1);
    case TT_F8E5M2: return (F)tt_d_f8_to_f32(((const uint8_t *)p)[i], 0);
    default: return (F)tt_d_load_int(dt, p, i);
  }
}

/* 16- and 8-bit floats round from float, as the host converters do. */
template <typename F>
__device__ __forceinline__ void tt_d_store_float(int dt, void *p, int64_t i, F v) {
  switch (dt) {
    case TT_F32: ((float *)p)[i] = (float)v; break;
    case TT_F64: ((double *)p)[i] = (double)v; break;
    case TT_BF16: ((uint16_t *)p)[i] = tt_d_f32_to_bf16((float)v); break;
    case TT_F16: ((uint16_t *)p)[i] = tt_d_f32_to_f16((float)v); break;
    case TT_F8E4M3: ((uint8_t *)p)[i] = tt_d_f32_to_f8((float)v, 1); break;
    case TT_F8E5M2: ((uint8_t *)p)[i] = tt_d_f32_to_f8((float)v, 0); break;
    case TT_I32: ((int32_t *)p)[i] = (int32_t)(long long)v; break;
    case TT_I64: ((int64_t *)p)[i] = (int64_t)v; break;
    case TT_U8: ((uint8_t *)p)[i] = (uint8_t)(long long)v; break;
    default: ((uint8_t *)p)[i] = v != (F)0; break;
  }
}

__device__ __forceinline__ void tt_d_store_int(int dt, void *p, int64_t i, long long v) {
  switch (dt) {
    case TT_I32: ((int32_t *)p)[i] = (int32_t)v; break;
    case TT_I64: ((int64_t *)p)[i] = (int64_t)v; break;
    case TT_U8: ((uint8_t *)p)[i] = (uint8_t)v; break;
    case TT_BOOL: ((uint8_t *)p)[i] = v != 0; break;
    case TT_F64: ((double *)p)[i] = (double)v; break;
    default: tt_d_store_float<float>(dt, p, i, (float)v); break;
  }
}

/* dst[di] = (dst_dt) src[si]. */
__device__ __forceinline__ void tt_d_convert(int sdt, const void *src, int64_t si, int ddt, void *dst, int64_t di) {
  if (tt_d_is_int(sdt)) tt_d_store_int(ddt, dst, di, tt_d_load_int(sdt, src, si));
  else if (sdt == TT_F64 || ddt == TT_F64) tt_d_store_float<double>(ddt, dst, di, tt_d_load_float<double>(sdt, src, si));
  else tt_d_store_float<float>(ddt, dst, di, tt_d_load_float<float>(sdt, src, si));
}

#endif
