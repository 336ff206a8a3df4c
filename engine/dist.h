/*
 * dist.h — the collectives backend table behind tt_group (engine/dist.c).
 * A backend implements the collectives for contiguous tensors whose shapes
 * dist.c has already validated.
 */
#ifndef TT_ENGINE_DIST_H
#define TT_ENGINE_DIST_H

#include "internal.h"

typedef struct tt_dist_backend {
  const char *name;
  /* Create the backend's communicator for g (rank, size, device set). */
  tt_status (*init)(tt_group *g, const uint8_t *unique_id, size_t id_len);
  void (*destroy)(tt_group *g);
  tt_status (*split)(tt_group *g, int color, int key, tt_group *out);
  tt_status (*all_reduce)(tt_group *g, tt_tensor *t, int op);
  tt_status (*reduce_scatter)(tt_group *g, const tt_tensor *in, tt_tensor *out, int op);
  tt_status (*all_gather)(tt_group *g, const tt_tensor *in, tt_tensor *out);
  tt_status (*broadcast)(tt_group *g, tt_tensor *t, int root);
  tt_status (*all_to_all)(tt_group *g, const tt_tensor *in, tt_tensor *out);
  tt_status (*send)(tt_group *g, const tt_tensor *t, int peer, int tag);
  tt_status (*recv)(tt_group *g, tt_tensor *t, int peer, int tag);
  tt_status (*barrier)(tt_group *g);
  /* Optional: start a send and return; *req is what wait needs (freed by it). */
  tt_status (*isend)(tt_group *g, const tt_tensor *t, int peer, int tag, void **req);
  tt_status (*wait)(tt_group *g, void *req);
  /* Optional: n sends (is_send[i]) and receives that progress together
   * (tt_dist_batch_p2p); without it dist.c starts the sends with isend,
   * receives, then waits for the sends. */
  tt_status (*batch_p2p)(tt_group *g, int n, const int *is_send, tt_tensor *const *ts, const int *peers,
                         const int *tags);
  /* Optional: start an all-reduce that later work does not wait for; *req
   * is what wait_coll needs (it makes later work wait for the collective,
   * and frees req). Without it dist.c runs all_reduce: the work is done. */
  tt_status (*all_reduce_async)(tt_group *g, tt_tensor *t, int op, void **req);
  tt_status (*wait_coll)(tt_group *g, void *req);
  /* Optional: a reduce-scatter and an all-gather started the same way
   * (FSDP's overlap), ended by wait_coll; without them dist.c runs the
   * blocking collective. */
  tt_status (*reduce_scatter_async)(tt_group *g, const tt_tensor *in, tt_tensor *out, int op, void **req);
  tt_status (*all_gather_async)(tt_group *g, const tt_tensor *in, tt_tensor *out, void **req);
  /* Optional: batch_p2p started the same way, ended by wait_coll; without it
   * dist.c runs the blocking batch_p2p. */
  tt_status (*batch_p2p_async)(tt_group *g, int n, const int *is_send, tt_tensor *const *ts, const int *peers,
                               const int *tags, void **req);
} tt_dist_backend;

struct tt_group {
  const tt_dist_backend *be;
  int rank, size, device;
  void *impl; /* the backend's communicator */
  /* Works not yet waited for (they read the group), and whether
   * tt_group_free came meanwhile: the last wait then frees the group, so
   * the order in which Lua's finalizers run at exit does not matter. */
  int works, free_pending;
  /* What this rank handed to each kind of collective (tt_coll_kind): calls
   * and payload bytes, counted where a call is validated (tt_group_traffic). */
  int64_t calls[TT_COLL_KINDS], bytes[TT_COLL_KINDS];
  /* What the watchdog's messages and trace call it (tt_group_set_label). */
  char label[96];
};

/* The watchdog (watchdog.c): a blocking call of dist.c, in flight from
 * begin to end (begin returns -1 when no watchdog runs). */
int64_t tt_watch_begin(const char *op, const tt_group *g, int64_t bytes);
void tt_watch_end(int64_t slot);

const tt_dist_backend *tt_dist_backend_fake(void);
/* Simulated ranks of this process (engine/sim.c, dist_local.c). */
const tt_dist_backend *tt_dist_backend_local(void);

/* Reductions across ranks (dist_reduce.c), the same arithmetic on every
 * backend that reduces on the host: acc = acc op x over n elements, for x
 * from rank 0, 1, ... in turn; then finish (avg divides by size). check:
 * the dtypes and ops it takes (float32/64 and integers; avg of floats). */
tt_status tt_dist_reduce_check(const char *who, int dtype, int op);
void tt_dist_reduce_into(void *acc, const void *x, int64_t n, int dtype, int op);
void tt_dist_reduce_finish(void *acc, int64_t n, int dtype, int op, int size);
/* NULL when built without Open MPI. */
const tt_dist_backend *tt_dist_backend_mpi(void);
/* NULL when built without NCCL. */
const tt_dist_backend *tt_dist_backend_nccl(void);

#endif
