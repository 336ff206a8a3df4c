/*
 * sim.c — N ranks of one job in this process (`titan --simulate N`), the
 * scheduler behind the "local" collectives backend (dist_local.c).
 *
 * Each rank runs on a stack of its own (ucontext), one at a time, on this
 * thread: a rank runs until it must wait for another (a collective not
 * every rank has reached, a message not yet sent), then the scheduler runs
 * the next rank that can go on. Why not one thread per rank: the ranks then
 * share nothing but what the collectives pass (each has its own Lua state),
 * and cooperative switching needs no locks in the engine, the caching
 * allocator, OpenMP or OpenBLAS, while every rank still gets every core for
 * its kernels. The order in which ranks run is fixed, so a simulated job
 * does the same thing in every run.
 *
 * A wait is a loop around tt_sim_block: the rank marks what it waits for,
 * hands over, and looks again when it is resumed. `progress` counts what
 * could unblock a rank (a rank reaching a new wait or finishing): a whole
 * round in which every rank left looked again and found nothing changed is
 * a deadlock, reported with what each rank waits for.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include "internal.h"
#include "sim.h"

enum { RANK_READY = 0, RANK_BLOCKED = 1, RANK_DONE = 2 };

typedef struct {
  ucontext_t ctx;
  void *stack;
  size_t stack_size;
  int state, rc;
  char what[192]; /* what the rank waits for, for the deadlock report */
} sim_rank;

static struct {
  int world, current;
  sim_rank *ranks;
  ucontext_t main;
  tt_sim_fn fn;
  void *arg;
  unsigned long progress, generation;
} S = { .current = -1 };

/* 16 MiB of address space a rank, reserved, not committed: LuaJIT, busted
 * and OpenMP's master frames use well under 1 MiB; a guard page below. */
#define SIM_STACK ((size_t)16 << 20)

/* Set on the thread that runs the simulation: other threads (a rank's
 * checkpoint writer) are no rank. */
static __thread int sim_thread;

int tt_sim_rank(void) { return S.ranks && sim_thread ? S.current : -1; }
int tt_sim_world(void) { return S.ranks && sim_thread ? S.world : 0; }
unsigned long tt_sim_generation(void) { return S.generation; }

static void sim_trampoline(void) {
  int r = S.current;
  int rc = S.fn(r, S.world, S.arg);
  S.ranks[r].rc = rc;
  S.ranks[r].state = RANK_DONE;
  S.progress++;
  /* returning resumes S.main (uc_link) */
}

void tt_sim_block(const char *what) {
  sim_rank *me = &S.ranks[S.current];
  if (me->state != RANK_BLOCKED || strcmp(me->what, what) != 0) {
    /* a new wait: this rank did something since it last handed over */
    S.progress++;
    snprintf(me->what, sizeof me->what, "%s", what);
  }
  me->state = RANK_BLOCKED;
  swapcontext(&me->ctx, &S.main);
}

void tt_sim_unblocked(void) {
  if (S.ranks && S.current >= 0) S.ranks[S.current].state = RANK_READY;
}

static void sim_free(void) {
  for (int r = 0; r < S.world; r++)
    if (S.ranks[r].stack) munmap(S.ranks[r].stack, S.ranks[r].stack_size);
  free(S.ranks);
  S.ranks = NULL;
  S.world = 0;
  S.current = -1;
}

static tt_status sim_deadlock(void) {
  char msg[2048];
  int n = snprintf(msg, sizeof msg, "simulate: deadlock: no rank can go on (");
  for (int r = 0; r < S.world && n < (int)sizeof msg - 64; r++) {
    const sim_rank *k = &S.ranks[r];
    n += snprintf(msg + n, sizeof msg - (size_t)n, "%srank %d %s", r ? "; " : "", r,
                  k->state == RANK_DONE ? "has finished" : k->what);
  }
  if (n < (int)sizeof msg - 2) snprintf(msg + n, sizeof msg - (size_t)n, ")");
  return tt_error_set(TT_ERR_INTERNAL, "%s", msg);
}

tt_status tt_sim_run(int world, tt_sim_fn fn, void *arg, int *failed_rank) {
  if (failed_rank) *failed_rank = -1;
  if (S.ranks) return tt_error_set(TT_ERR_INVALID, "simulate: a simulation is already running in this process");
  if (world < 1 || world > 4096)
    return tt_error_set(TT_ERR_INVALID, "simulate: %d ranks; expected 1 to 4096", world);
  S.ranks = calloc((size_t)world, sizeof *S.ranks);
  if (!S.ranks) return tt_error_set(TT_ERR_OOM, "simulate: out of host memory for %d ranks", world);
  S.world = world;
  S.fn = fn;
  S.arg = arg;
  S.generation++;
  sim_thread = 1;
  tt_alloc_sim_begin(world);
  long page = sysconf(_SC_PAGESIZE);
  for (int r = 0; r < world; r++) {
    sim_rank *k = &S.ranks[r];
    k->stack_size = SIM_STACK;
    k->stack = mmap(NULL, k->stack_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (k->stack == MAP_FAILED) {
      k->stack = NULL;
      sim_free();
      return tt_error_set(TT_ERR_OOM, "simulate: cannot reserve a stack for rank %d of %d", r, world);
    }
    mprotect(k->stack, (size_t)page, PROT_NONE); /* an overflow faults instead of writing into a neighbour */
    getcontext(&k->ctx);
    k->ctx.uc_stack.ss_sp = k->stack;
    k->ctx.uc_stack.ss_size = k->stack_size;
    k->ctx.uc_link = &S.main;
    makecontext(&k->ctx, sim_trampoline, 0);
  }
  tt_status st = TT_OK;
  for (;;) {
    int live = 0, stuck = 1;
    unsigned long before = S.progress;
    for (int r = 0; r < world; r++) {
      sim_rank *k = &S.ranks[r];
      if (k->state == RANK_DONE) continue;
      live++;
      S.current = r;
      swapcontext(&S.main, &k->ctx);
      if (k->state == RANK_DONE && k->rc != 0) {
        if (failed_rank) *failed_rank = r;
        st = tt_error_set(TT_ERR_INVALID, "simulate: rank %d of %d failed", r, world);
        goto out;
      }
      if (k->state != RANK_BLOCKED) stuck = 0;
    }
    if (!live) break;
    if (stuck && S.progress == before) {
      st = sim_deadlock();
      goto out;
    }
  }
out:
  sim_free();
  tt_alloc_sim_end();
  sim_thread = 0;
  return st;
}
