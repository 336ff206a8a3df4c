/*
 * sim.h — what the "local" collectives backend (dist_local.c) needs from
 * the simulator's scheduler (sim.c).
 */
#ifndef TT_ENGINE_SIM_H
#define TT_ENGINE_SIM_H

/* Hands over to the next rank; `what` says what this rank waits for (the
 * deadlock report). The caller loops: while (!ready) tt_sim_block(what). */
void tt_sim_block(const char *what);
/* After such a loop: this rank runs again. */
void tt_sim_unblocked(void);
/* Which simulation this is (a new number for each tt_sim_run): state kept
 * for one simulation is dropped when another starts. */
unsigned long tt_sim_generation(void);

/* Per-rank allocator statistics (alloc.c), for the length of a simulation. */
void tt_alloc_sim_begin(int world);
void tt_alloc_sim_end(void);

#endif
