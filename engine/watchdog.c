/*
 * watchdog.c — collective timeouts and a flight recorder (TorchTitan's
 * comm.init_timeout_seconds / train_timeout_seconds, PyTorch's NCCL flight
 * recorder).
 *
 * A rank that stops (SIGSTOP, a hung device, a deadlock in its own code)
 * leaves every other rank waiting inside a collective for ever, spinning:
 * MPI polls. Every blocking call of engine/dist.c is bracketed by
 * tt_watch_begin/tt_watch_end, which record it in a ring of the last
 * `capacity` calls (op, group, bytes, when it started and ended). A thread
 * wakes once a second; when the call in flight has waited longer than the
 * timeout, it writes the ring to the trace file, prints one line naming the
 * collective, its group and the wait, and ends the process (exit code 124,
 * as timeout(1)): the launcher then stops the other ranks.
 *
 * Only one call is in flight per process (a rank's collectives are
 * issued by one thread); simulated ranks (engine/sim.c) have their own
 * deadlock detection and no watchdog.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "dist.h"
#include "internal.h"

typedef struct {
  uint64_t seq;
  const char *op;
  char group[96];
  int64_t bytes;
  double start, end; /* seconds (CLOCK_MONOTONIC); end 0: in flight */
} tt_watch_entry;

static struct {
  pthread_mutex_t lock;
  pthread_t thread;
  int running;
  tt_watch_entry *ring;
  int capacity;
  uint64_t next;      /* the next entry's sequence number */
  int64_t in_flight;  /* the ring slot of the call in flight, or -1 */
  double init_timeout, train_timeout;
  int training;       /* 0: the init timeout applies (start-up, the first step) */
  int rank, world;
  char trace_path[1024];
  double wall0, mono0; /* to write wall-clock times */
} W = { PTHREAD_MUTEX_INITIALIZER, 0, 0, NULL, 0, 0, -1, 0, 0, 0, 0, 1, "", 0, 0 };

static double tt_mono(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double tt_wall(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int64_t tt_watch_begin(const char *op, const tt_group *g, int64_t bytes) {
  if (!W.ring) return -1;
  pthread_mutex_lock(&W.lock);
  int64_t slot = (int64_t)(W.next % (uint64_t)W.capacity);
  tt_watch_entry *e = &W.ring[slot];
  e->seq = W.next++;
  e->op = op;
  if (g && g->label[0])
    snprintf(e->group, sizeof e->group, "%s", g->label);
  else if (g)
    snprintf(e->group, sizeof e->group, "a group of %d ranks (this rank %d of them)", g->size, g->rank);
  else
    snprintf(e->group, sizeof e->group, "-");
  e->bytes = bytes;
  e->start = tt_mono();
  e->end = 0;
  W.in_flight = slot;
  pthread_mutex_unlock(&W.lock);
  return slot;
}

void tt_watch_end(int64_t slot) {
  if (slot < 0 || !W.ring) return;
  pthread_mutex_lock(&W.lock);
  W.ring[slot].end = tt_mono();
  if (W.in_flight == slot) W.in_flight = -1;
  pthread_mutex_unlock(&W.lock);
}

/* The ring, oldest first, one JSON object a line. Called with the lock held. */
static int tt_watch_write(const char *path, double now) {
  FILE *f = fopen(path, "w");
  if (!f) return -1;
  uint64_t n = W.next < (uint64_t)W.capacity ? W.next : (uint64_t)W.capacity;
  for (uint64_t s = W.next - n; s < W.next; s++) {
    const tt_watch_entry *e = &W.ring[s % (uint64_t)W.capacity];
    fprintf(f,
            "{\"seq\":%llu,\"rank\":%d,\"world\":%d,\"op\":\"%s\",\"group\":\"%s\",\"bytes\":%lld,"
            "\"start_time\":%.6f,\"%s\":%.6f}\n",
            (unsigned long long)e->seq, W.rank, W.world, e->op, e->group, (long long)e->bytes,
            W.wall0 + (e->start - W.mono0), e->end > 0 ? "seconds" : "waiting_seconds",
            (e->end > 0 ? e->end : now) - e->start);
  }
  int bad = ferror(f);
  return fclose(f) != 0 || bad ? -1 : 0;
}

static void *tt_watch_main(void *arg) {
  (void)arg;
  for (;;) {
    sleep(1);
    pthread_mutex_lock(&W.lock);
    if (!W.running) {
      pthread_mutex_unlock(&W.lock);
      return NULL;
    }
    double now = tt_mono(), limit = W.training ? W.train_timeout : W.init_timeout;
    if (W.in_flight >= 0 && limit > 0 && now - W.ring[W.in_flight].start > limit) {
      const tt_watch_entry *e = &W.ring[W.in_flight];
      int wrote = W.trace_path[0] ? tt_watch_write(W.trace_path, now) : -1;
      char where[1200];
      if (wrote == 0)
        snprintf(where, sizeof where, "this rank's last %llu collectives are in %s",
                 (unsigned long long)(W.next < (uint64_t)W.capacity ? W.next : (uint64_t)W.capacity), W.trace_path);
      else
        snprintf(where, sizeof where, "no trace written%s%s", W.trace_path[0] ? " to " : "", W.trace_path);
      fprintf(stderr,
              "titan (rank %d of %d): %s #%llu on %s (%lld bytes) has waited %.0f s, more than "
              "comm.%s_timeout_seconds = %.0f: another rank of the group has not reached it (stopped, stuck on its "
              "device, or in another collective); stopping the job; %s\n",
              W.rank, W.world, e->op, (unsigned long long)e->seq, e->group, (long long)e->bytes, now - e->start,
              W.training ? "train" : "init", limit, where);
      fflush(stderr);
      _exit(124);
    }
    pthread_mutex_unlock(&W.lock);
  }
}

tt_status tt_watchdog_start(int rank, int world, double init_timeout_s, double train_timeout_s, int capacity,
                            const char *trace_path) {
  if (capacity < 1) return tt_error_set(TT_ERR_INVALID, "watchdog: capacity %d; expected at least 1", capacity);
  if (init_timeout_s < 0 || train_timeout_s < 0)
    return tt_error_set(TT_ERR_INVALID, "watchdog: timeouts %g and %g; expected >= 0 (0: none)", init_timeout_s,
                        train_timeout_s);
  pthread_mutex_lock(&W.lock);
  if (W.running) { /* a second trainer in this process: the settings change, one thread */
    W.init_timeout = init_timeout_s;
    W.train_timeout = train_timeout_s;
    W.training = 0;
    snprintf(W.trace_path, sizeof W.trace_path, "%s", trace_path ? trace_path : "");
    pthread_mutex_unlock(&W.lock);
    return TT_OK;
  }
  tt_watch_entry *ring = calloc((size_t)capacity, sizeof *ring);
  if (!ring) {
    pthread_mutex_unlock(&W.lock);
    return tt_error_set(TT_ERR_OOM, "watchdog: out of host memory for %d entries", capacity);
  }
  W.ring = ring;
  W.capacity = capacity;
  W.next = 0;
  W.in_flight = -1;
  W.init_timeout = init_timeout_s;
  W.train_timeout = train_timeout_s;
  W.training = 0;
  W.rank = rank;
  W.world = world;
  W.mono0 = tt_mono();
  W.wall0 = tt_wall();
  snprintf(W.trace_path, sizeof W.trace_path, "%s", trace_path ? trace_path : "");
  W.running = 1;
  int rc = pthread_create(&W.thread, NULL, tt_watch_main, NULL);
  if (rc != 0) {
    W.running = 0;
    W.ring = NULL;
    free(ring);
    pthread_mutex_unlock(&W.lock);
    return tt_error_set(TT_ERR_INTERNAL, "watchdog: cannot start its thread: %s", strerror(rc));
  }
  pthread_detach(W.thread);
  pthread_mutex_unlock(&W.lock);
  return TT_OK;
}

void tt_watchdog_training(void) {
  pthread_mutex_lock(&W.lock);
  W.training = 1;
  pthread_mutex_unlock(&W.lock);
}

tt_status tt_watchdog_dump(const char *path) {
  pthread_mutex_lock(&W.lock);
  int rc = W.ring ? tt_watch_write(path, tt_mono()) : 0;
  pthread_mutex_unlock(&W.lock);
  return rc == 0 ? TT_OK : tt_error_set(TT_ERR_IO, "watchdog: cannot write %s: %s", path, strerror(errno));
}
