/* timer.c — the device clock (titan.h): marks recorded where the device's
 * work runs, read once at the end. On a GPU a mark is an event on the
 * compute stream, so the time between two marks is what the stream spent
 * on the work enqueued between them (and any wait for the host to enqueue
 * it), with no host wait in between; on the CPU, whose kernels run as they
 * are called, it is the host's monotonic clock. */
#include <stdlib.h>
#include <time.h>

#include "internal.h"

struct tt_timer {
  tt_device dev;
  const tt_kernels *be; /* NULL on the CPU: the host clock */
  int64_t count, cap;
  void **events; /* cuda: made on first need, kept for the next round */
  int64_t made;
  double *host; /* cpu: the marks' seconds */
};

static double tt_timer_host_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

tt_status tt_timer_new(tt_device dev, tt_timer **out) {
  char dn[24];
  if (!out) return tt_error_set(TT_ERR_INVALID, "timer: NULL output");
  *out = NULL;
  const tt_kernels *be = NULL;
  if (dev.type == TT_CUDA) {
    be = tt_backend(dev);
    if (!be) return tt_error_set(TT_ERR_DEVICE, "timer: %s is not available in this build or on this machine",
                                 tt_device_name(dev, dn, sizeof dn));
    if (!be->timer_event_new || !be->timer_event_mark || !be->timer_event_elapsed || !be->event_wait ||
        !be->event_free)
      return tt_error_set(TT_ERR_UNSUPPORTED, "timer: %s's backend has no timing events",
                          tt_device_name(dev, dn, sizeof dn));
  } else if (dev.type != TT_CPU) {
    return tt_error_set(TT_ERR_INVALID, "timer: %s runs no work to time (expected cpu or cuda:N)",
                        tt_device_name(dev, dn, sizeof dn));
  }
  tt_timer *t = calloc(1, sizeof *t);
  if (!t) return tt_error_set(TT_ERR_OOM, "timer: out of host memory");
  t->dev = dev;
  t->be = be;
  *out = t;
  return TT_OK;
}

/* Room for one more mark. */
static tt_status tt_timer_grow(tt_timer *t) {
  if (t->count < t->cap) return TT_OK;
  int64_t cap = t->cap ? 2 * t->cap : 256;
  if (t->be) {
    void **ev = realloc(t->events, (size_t)cap * sizeof *ev);
    if (!ev) return tt_error_set(TT_ERR_OOM, "timer: out of host memory for %lld marks", (long long)cap);
    t->events = ev;
  } else {
    double *h = realloc(t->host, (size_t)cap * sizeof *h);
    if (!h) return tt_error_set(TT_ERR_OOM, "timer: out of host memory for %lld marks", (long long)cap);
    t->host = h;
  }
  t->cap = cap;
  return TT_OK;
}

tt_status tt_timer_mark(tt_timer *t) {
  if (!t) return tt_error_set(TT_ERR_INVALID, "timer: NULL timer");
  TT_TRY(tt_timer_grow(t));
  if (!t->be) {
    t->host[t->count++] = tt_timer_host_now();
    return TT_OK;
  }
  if (t->count == t->made) {
    TT_TRY(t->be->timer_event_new(t->dev.index, &t->events[t->made]));
    t->made++;
  }
  TT_TRY(t->be->timer_event_mark(t->dev.index, t->events[t->count]));
  t->count++;
  return TT_OK;
}

int64_t tt_timer_count(const tt_timer *t) { return t ? t->count : 0; }

tt_status tt_timer_read(tt_timer *t, double *seconds, int64_t n) {
  if (!t || (!seconds && n > 0)) return tt_error_set(TT_ERR_INVALID, "timer: NULL timer or output");
  if (n < 0 || n > t->count)
    return tt_error_set(TT_ERR_INVALID, "timer: read of %lld marks, but %lld were made", (long long)n,
                        (long long)t->count);
  if (n == 0) return TT_OK;
  /* One host wait, for the last mark made: the stream ran the others first. */
  if (t->be) TT_TRY(t->be->event_wait(t->events[t->count - 1]));
  seconds[0] = 0.0;
  for (int64_t i = 1; i < n; i++) {
    if (!t->be) {
      seconds[i] = t->host[i] - t->host[0];
      continue;
    }
    /* Each from mark 0: float milliseconds keep about 0.1 us at a second,
     * and no error adds up along the marks. */
    float ms = 0.0f;
    TT_TRY(t->be->timer_event_elapsed(t->events[0], t->events[i], &ms));
    seconds[i] = 1e-3 * (double)ms;
  }
  return TT_OK;
}

void tt_timer_clear(tt_timer *t) {
  if (t) t->count = 0;
}

void tt_timer_free(tt_timer *t) {
  if (!t) return;
  for (int64_t i = 0; i < t->made; i++) t->be->event_free(t->events[i]);
  free(t->events);
  free(t->host);
  free(t);
}
