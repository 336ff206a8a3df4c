/* error.c — the last error, one per thread (async checkpoint writers and
 * OpenMP threads must not overwrite the main thread's message). */
#include <stdarg.h>
#include <stdio.h>

#include "internal.h"

static _Thread_local char tt_err_buf[1024];

tt_status tt_error_set(int status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(tt_err_buf, sizeof tt_err_buf, fmt, ap);
  va_end(ap);
  return (tt_status)status;
}

const char *tt_last_error(void) { return tt_err_buf; }

void tt_clear_error(void) { tt_err_buf[0] = 0; }
