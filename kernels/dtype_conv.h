/*
 * dtype_conv.h — scalar conversions between f32 and the 16- and 8-bit float
 * formats, shared by the engine and every CPU kernel. Round-to-nearest-even
 * everywhere, NaN preserved. fp8 casts saturate: a finite value beyond the
 * largest finite one becomes it (e5m2 keeps true infinities), the OCP fp8
 * spec's saturating mode and what float8 training does (torchao clamps
 * before it casts); a bare torch .to(float8_e4m3fn) would give NaN there.
 */
#ifndef TT_DTYPE_CONV_H
#define TT_DTYPE_CONV_H

#include <stdint.h>
#include <string.h>
#include <math.h>

static inline float tt_bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t tt_f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

static inline float tt_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else { /* subnormal: renormalize */
      exp = 127 - 15 + 1;
      while (!(man & 0x400u)) { man <<= 1; exp--; }
      man &= 0x3ffu;
      u = sign | (exp << 23) | (man << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t tt_f32_to_f16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65520: inf */
  if (a < 0x38800000u) {                                   /* below f16 normal range */
    if (a < 0x33000000u) return (uint16_t)sign;            /* < half the smallest subnormal */
    /* f16 subnormals are multiples of 2^-24: r = round(a * 2^24), which for
     * a = M * 2^(e - 150) is M >> (126 - e), rounded to nearest even. */
    uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - e; /* 14..24 */
    uint32_t r = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) r++;
    return (uint16_t)(sign | r);
  }
  uint32_t r = a - 0x38000000u; /* rebias exponent 127 -> 15 */
  r += 0xfffu + ((r >> 13) & 1u);
  return (uint16_t)(sign | (r >> 13));
}

/* fp8 via f32: generic encoder for a format with `ebits` exponent bits,
 * `mbits` mantissa bits and bias; e4m3fn has no inf and max 448, e5m2 is
 * IEEE-like with max 57344. */
static inline float tt_f8_to_f32(uint8_t x, int e4m3) {
  int sign = x >> 7;
  int mbits = e4m3 ? 3 : 2, ebits = e4m3 ? 4 : 5, bias = e4m3 ? 7 : 15;
  int e = (x >> mbits) & ((1 << ebits) - 1);
  int m = x & ((1 << mbits) - 1);
  float v;
  if (e4m3 && e == 15 && m == 7) return NAN;
  if (!e4m3 && e == 31) return m ? NAN : (sign ? -INFINITY : INFINITY);
  if (e == 0) v = ldexpf((float)m, 1 - bias - mbits);
  else v = ldexpf((float)(m | (1 << mbits)), e - bias - mbits);
  return sign ? -v : v;
}

static inline uint8_t tt_f32_to_f8(float f, int e4m3) {
  int mbits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
  float maxv = e4m3 ? 448.0f : 57344.0f;
  uint8_t sign = signbit(f) ? 0x80 : 0;
  if (isnan(f)) return e4m3 ? 0x7f : 0x7f;
  float a = fabsf(f);
  if (a == 0.0f) return sign; /* frexpf(0) gives e = 0, which would encode 0.5 */
  if (a >= maxv) { /* saturate (e5m2 keeps inf for true inf) */
    if (!e4m3 && isinf(a)) return sign | 0x7c;
    return sign | (e4m3 ? 0x7e : 0x7b);
  }
  int e;
  frexpf(a, &e); /* a = fr * 2^e, fr in [0.5,1) */
  int exp_field = e - 1 + bias;
  int q; /* value in units of the format's ulp at this exponent */
  if (exp_field <= 0) { /* subnormal */
    q = (int)nearbyintf(ldexpf(a, bias - 1 + mbits));
    return sign | (uint8_t)q; /* q may carry into the first normal: same encoding */
  }
  q = (int)nearbyintf(ldexpf(a, mbits - (e - 1)));
  if (q >= (2 << mbits)) { q >>= 1; exp_field++; }
  uint8_t enc = (uint8_t)((exp_field << mbits) | (q & ((1 << mbits) - 1)));
  return sign | enc;
}

#endif
