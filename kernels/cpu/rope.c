/*
 * rope.c — rotary position embeddings (CPU): the cos/sin table and the
 * rotation, in the TorchTitan / Meta Llama convention (adjacent pairs
 * (2i, 2i+1) of the head dim, freq_i = theta^(-2i/D)).
 *
 * The table is computed in double whatever its dtype, so an f32 table is
 * the correctly rounded cos/sin of the exact angle; Meta computes the angles
 * in f32, which loses ~1e-4 rad at position 8k. The rotation by the negative
 * angle (inverse) is both the inverse and the gradient of the rotation.
 */
#include <math.h>

#include "cpu.h"

#define ROPE_PAR_MIN 32768
/* Frequencies computed at a time into a stack buffer while the table is
 * filled row by row (keeps writes contiguous without allocating). */
#define ROPE_FREQ_CHUNK 64

/* Meta's Llama 3.1 `apply_scaling`: long wavelengths (beyond the original
 * context) are slowed by scale_factor, short ones kept, the band between
 * blended linearly in original_max_seq / wavelen. */
static double rope_scaled_freq(double freq, double scale_factor, double low_freq_factor, double high_freq_factor,
                               double original_max_seq) {
  double wavelen = 2.0 * M_PI / freq;
  double low_freq_wavelen = original_max_seq / low_freq_factor;
  double high_freq_wavelen = original_max_seq / high_freq_factor;
  if (wavelen < high_freq_wavelen) return freq;
  if (wavelen > low_freq_wavelen) return freq / scale_factor;
  /* Meta asserts the band is not empty; with equal factors only
   * wavelen == the common bound lands here, which the high side keeps. */
  if (high_freq_factor == low_freq_factor) return freq;
  double smooth = (original_max_seq / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
  return (1.0 - smooth) * freq / scale_factor + smooth * freq;
}

#define DEF_ROPE_TABLE(T, SFX)                                                                                        \
  static void rope_table_##SFX(int64_t head_dim, int64_t max_seq, double theta, double scale_factor,                  \
                               double low_freq_factor, double high_freq_factor, int64_t original_max_seq,             \
                               T *restrict cs, T *restrict sn) {                                                      \
    int64_t half = head_dim / 2;                                                                                      \
    int par = max_seq > 1 && max_seq * half >= ROPE_PAR_MIN;                                                          \
    _Pragma("omp parallel if (par)") {                                                                                \
      double freq[ROPE_FREQ_CHUNK];                                                                                   \
      for (int64_t i0 = 0; i0 < half; i0 += ROPE_FREQ_CHUNK) {                                                        \
        int64_t n = half - i0 < ROPE_FREQ_CHUNK ? half - i0 : ROPE_FREQ_CHUNK;                                        \
        for (int64_t i = 0; i < n; i++) {                                                                             \
          double f = 1.0 / pow(theta, (double)(2 * (i0 + i)) / (double)head_dim);                                     \
          if (scale_factor > 1.0)                                                                                     \
            f = rope_scaled_freq(f, scale_factor, low_freq_factor, high_freq_factor, (double)original_max_seq);       \
          freq[i] = f;                                                                                                \
        }                                                                                                             \
        _Pragma("omp for schedule(static)") for (int64_t p = 0; p < max_seq; p++) {                                   \
          for (int64_t i = 0; i < n; i++) {                                                                           \
            double angle = (double)p * freq[i];                                                                       \
            cs[p * half + i0 + i] = (T)cos(angle);                                                                    \
            sn[p * half + i0 + i] = (T)sin(angle);                                                                    \
          }                                                                                                           \
        }                                                                                                             \
      }                                                                                                               \
    }                                                                                                                 \
  }

/* One head: y[2i] = x[2i] c - x[2i+1] s, y[2i+1] = x[2i] s + x[2i+1] c, with
 * s negated for the inverse. The in-place variant takes a single pointer so
 * the compiler sees the distance-0 dependence and vectorizes without an
 * aliasing check that would fail at run time. */
#define DEF_ROPE(T, SFX)                                                                                              \
  static inline void rope_head_##SFX(const T *restrict x, T *restrict y, const T *restrict c,                         \
                                     const T *restrict s, T sg, int64_t half) {                                       \
    for (int64_t i = 0; i < half; i++) {                                                                              \
      T a = x[2 * i], b = x[2 * i + 1], si = sg * s[i];                                                               \
      y[2 * i] = a * c[i] - b * si;                                                                                   \
      y[2 * i + 1] = a * si + b * c[i];                                                                               \
    }                                                                                                                 \
  }                                                                                                                   \
  static inline void rope_head_inplace_##SFX(T *restrict x, const T *restrict c, const T *restrict s, T sg,           \
                                             int64_t half) {                                                          \
    for (int64_t i = 0; i < half; i++) {                                                                              \
      T a = x[2 * i], b = x[2 * i + 1], si = sg * s[i];                                                               \
      x[2 * i] = a * c[i] - b * si;                                                                                   \
      x[2 * i + 1] = a * si + b * c[i];                                                                               \
    }                                                                                                                 \
  }                                                                                                                   \
  static void rope_##SFX(int64_t B, int64_t T_, int64_t H, int64_t D, const T *x, const T *cs, const T *sn,           \
                         int64_t pos_offset, int inverse, T *y) {                                                     \
    int64_t half = D / 2;                                                                                             \
    T sg = inverse ? (T)-1 : (T)1;                                                                                    \
    int par = B * T_ > 1 && B * T_ * H * D >= ROPE_PAR_MIN;                                                           \
    _Pragma("omp parallel for schedule(static) if (par)") for (int64_t bt = 0; bt < B * T_; bt++) {                   \
      int64_t pos = pos_offset + bt % T_;                                                                             \
      const T *c = cs + pos * half, *s = sn + pos * half;                                                             \
      for (int64_t h = 0; h < H; h++) {                                                                               \
        int64_t off = (bt * H + h) * D;                                                                               \
        if (x == y)                                                                                                   \
          rope_head_inplace_##SFX(y + off, c, s, sg, half);                                                           \
        else                                                                                                          \
          rope_head_##SFX(x + off, y + off, c, s, sg, half);                                                          \
      }                                                                                                               \
    }                                                                                                                 \
  }

DEF_ROPE_TABLE(float, f32)
DEF_ROPE_TABLE(double, f64)
DEF_ROPE(float, f32)
DEF_ROPE(double, f64)

tt_status tt_cpu_rope_table(int dtype, int64_t head_dim, int64_t max_seq, double theta, double scale_factor,
                            double low_freq_factor, double high_freq_factor, int64_t original_max_seq, void *cos,
                            void *sin) {
  if (head_dim % 2) return TT_ERR_SHAPE;
  switch (dtype) {
  case TT_F32:
    rope_table_f32(head_dim, max_seq, theta, scale_factor, low_freq_factor, high_freq_factor, original_max_seq, cos,
                   sin);
    return TT_OK;
  case TT_F64:
    rope_table_f64(head_dim, max_seq, theta, scale_factor, low_freq_factor, high_freq_factor, original_max_seq, cos,
                   sin);
    return TT_OK;
  default: return TT_ERR_DTYPE;
  }
}

tt_status tt_cpu_rope(int dtype, int64_t B, int64_t T, int64_t H, int64_t D, const void *x, const void *cos,
                      const void *sin, int64_t pos_offset, int inverse, void *y) {
  if (D % 2) return TT_ERR_SHAPE;
  switch (dtype) {
  case TT_F32: rope_f32(B, T, H, D, x, cos, sin, pos_offset, inverse, y); return TT_OK;
  case TT_F64: rope_f64(B, T, H, D, x, cos, sin, pos_offset, inverse, y); return TT_OK;
  default: return TT_ERR_DTYPE;
  }
}
