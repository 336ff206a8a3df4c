/* dtype.c — element sizes and names. */
#include "internal.h"

static const struct {
  size_t size;
  const char *name;
  int is_float;
} tt_dtypes[TT_NUM_DTYPES] = {
    [TT_F32] = {4, "float32", 1},   [TT_F64] = {8, "float64", 1},      [TT_BF16] = {2, "bfloat16", 1},
    [TT_F16] = {2, "float16", 1},   [TT_I32] = {4, "int32", 0},        [TT_I64] = {8, "int64", 0},
    [TT_U8] = {1, "uint8", 0},      [TT_BOOL] = {1, "bool", 0},        [TT_F8E4M3] = {1, "float8_e4m3fn", 1},
    [TT_F8E5M2] = {1, "float8_e5m2", 1},
};

size_t tt_dtype_size(int dtype) { return (dtype >= 0 && dtype < TT_NUM_DTYPES) ? tt_dtypes[dtype].size : 0; }

const char *tt_dtype_name(int dtype) {
  return (dtype >= 0 && dtype < TT_NUM_DTYPES) ? tt_dtypes[dtype].name : "invalid";
}

int tt_dtype_is_float(int dtype) { return (dtype >= 0 && dtype < TT_NUM_DTYPES) ? tt_dtypes[dtype].is_float : 0; }
