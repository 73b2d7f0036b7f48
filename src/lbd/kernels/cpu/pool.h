/* Work sharing for the CPU kernels: lbd_parallel_for(fn, ctx, n) runs fn(ctx, i) for every i < n.
 *
 * With the pool started (lbd_pool_start, once, by the engine core), the calling thread and the pool's pinned
 * helper threads claim chunks from one atomic counter, and the caller returns as soon as every chunk is done:
 * it never waits for a helper that did not start. Without the pool, it is an OpenMP loop (torch's threads).
 */
#ifndef LBD_POOL_H
#define LBD_POOL_H
#include <stdint.h>

typedef void (*lbd_task_fn)(void *ctx, int64_t index);

void lbd_parallel_for(lbd_task_fn fn, void *ctx, int64_t n);
/* Threads that may run chunks at once (the pool's size, or OpenMP's), for sizing the chunks. */
int lbd_parallel_threads(void);

#endif
