/* The CPU kernels' thread pool: pinned helpers that share a loop's chunks with the caller, and never make it
 * wait for a helper that did not show up.
 *
 * Why not OpenMP: a decode step runs a few hundred short parallel loops, and an OpenMP loop ends at a barrier
 * that waits for every thread. On two cores shared with the front end (and, on a busy host, with anything
 * else), one of them is often descheduled; the loop then takes a time slice instead of tens of microseconds.
 * Measured on this project's 2-core machine under load: a decode step of 32 sequences took 1.4-1.9 s with two
 * OpenMP threads and 0.38 s with one. Here the chunks sit behind one atomic counter that the caller and the
 * helpers claim from; the caller returns once every chunk is done, so a descheduled helper costs at most the
 * one chunk it holds, and with no helper at all the caller does the whole loop at one-thread speed.
 *
 * Protocol: state = generation << 32 | next chunk. The caller closes the old generation (next = CLOSED), writes
 * the job, then opens the new one (next = 0); a helper claims chunk c with a compare-and-swap on (gen, c), so a
 * helper that read a stale job cannot claim in a newer generation. Helpers spin briefly after work (a layer's
 * loops come microseconds apart), then sleep on a futex. Only one thread runs a pooled loop at a time (the
 * engine core's); another caller, or a loop inside a chunk, runs on its own thread.
 */
#define _GNU_SOURCE
#include "pool.h"

#include <limits.h>
#include <linux/futex.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() sched_yield()
#endif

#define CLOSED 0xFFFFFFFFu
#define SPIN_NS 100000 /* helpers keep spinning this long after their last chunk, then sleep */

static struct {
    _Atomic int threads; /* 0: not started (OpenMP is used) */
    _Atomic uint64_t state;
    _Atomic int64_t done;
    _Atomic(lbd_task_fn) fn;
    _Atomic(void *) ctx;
    _Atomic int64_t n;
    _Atomic uint32_t wake; /* futex word */
    _Atomic int sleepers;
    atomic_flag busy;
} P = {.busy = ATOMIC_FLAG_INIT};
static uint32_t generation; /* written only by the caller holding P.busy */
static _Thread_local int in_chunk;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int pin(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return sched_setaffinity(0, sizeof set, &set);
}

/* Claim and run chunks of generation ``gen`` until none are left (or a newer generation started). */
static void run_chunks(uint32_t gen) {
    const lbd_task_fn fn = atomic_load_explicit(&P.fn, memory_order_relaxed);
    void *const ctx = atomic_load_explicit(&P.ctx, memory_order_relaxed);
    const int64_t n = atomic_load_explicit(&P.n, memory_order_relaxed);
    uint64_t s = atomic_load(&P.state);
    while ((uint32_t)(s >> 32) == gen && (int64_t)(uint32_t)s < n) {
        if (atomic_compare_exchange_weak(&P.state, &s, s + 1)) {
            in_chunk = 1;
            fn(ctx, (int64_t)(uint32_t)s);
            in_chunk = 0;
            atomic_fetch_add_explicit(&P.done, 1, memory_order_release);
            s = atomic_load(&P.state);
        }
    }
}

static void *helper(void *arg) {
    pin((int)(intptr_t)arg);
    uint32_t seen = (uint32_t)(atomic_load(&P.state) >> 32);
    int64_t last = now_ns();
    for (;;) {
        const uint64_t s = atomic_load_explicit(&P.state, memory_order_acquire);
        const uint32_t gen = (uint32_t)(s >> 32);
        if (gen != seen && (uint32_t)s != CLOSED) {
            run_chunks(gen);
            seen = gen;
            last = now_ns();
            continue;
        }
        if (now_ns() - last < SPIN_NS) {
            for (int i = 0; i < 64; ++i) CPU_RELAX();
            continue;
        }
        atomic_fetch_add(&P.sleepers, 1);
        const uint32_t w = atomic_load(&P.wake);
        if ((uint32_t)(atomic_load(&P.state) >> 32) == seen)
            syscall(SYS_futex, &P.wake, FUTEX_WAIT_PRIVATE, w, NULL, NULL, 0);
        atomic_fetch_sub(&P.sleepers, 1);
        last = now_ns();
    }
    return NULL;
}

/* Start helpers pinned to cpus[1..n-1]; the caller (cpus[0] is meant for it) is not pinned here, since the
 * processes it starts later would inherit that (the engine core pins its thread itself). Once per process. */
int lbd_pool_start(const int *cpus, int n) {
    if (atomic_load(&P.threads) != 0) return atomic_load(&P.threads) == n ? 0 : -1;
    if (n < 1) return -1;
    for (int i = 1; i < n; ++i) {
        pthread_t t;
        if (pthread_create(&t, NULL, helper, (void *)(intptr_t)cpus[i]) != 0) return -1;
        pthread_detach(t);
    }
    atomic_store(&P.threads, n);
    return 0;
}

int lbd_pool_threads(void) { return atomic_load(&P.threads); }

/* The instruction-set level this build's kernels were compiled for: the index in build.py's LEVELS (0 scalar,
 * 1 AVX2 with FMA, 2 AVX-512F, 3 AVX-512 BF16), so the loader can refuse a build below the level it asked for. */
int lbd_isa(void) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    return 3;
#elif defined(__AVX512F__)
    return 2;
#elif defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

int lbd_parallel_threads(void) {
    const int t = atomic_load(&P.threads);
    return t > 0 ? t : omp_get_max_threads();
}

void lbd_parallel_for(lbd_task_fn fn, void *ctx, int64_t n) {
    if (n <= 0) return;
    const int threads = atomic_load(&P.threads);
    if (threads == 0 && n > 1 && !in_chunk) {
#pragma omp parallel for schedule(dynamic, 1)
        for (int64_t i = 0; i < n; ++i) fn(ctx, i);
        return;
    }
    if (threads <= 1 || n == 1 || in_chunk || atomic_flag_test_and_set(&P.busy)) {
        for (int64_t i = 0; i < n; ++i) fn(ctx, i);
        return;
    }
    const uint32_t gen = ++generation;
    atomic_store(&P.state, (uint64_t)gen << 32 | CLOSED);
    atomic_store_explicit(&P.fn, fn, memory_order_relaxed);
    atomic_store_explicit(&P.ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&P.n, n, memory_order_relaxed);
    atomic_store(&P.done, 0);
    atomic_store_explicit(&P.state, (uint64_t)gen << 32, memory_order_release);
    atomic_fetch_add(&P.wake, 1);
    if (atomic_load(&P.sleepers) > 0) syscall(SYS_futex, &P.wake, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    run_chunks(gen);
    while (atomic_load_explicit(&P.done, memory_order_acquire) < n) CPU_RELAX();
    atomic_flag_clear(&P.busy);
}

/* Without the pool (torch's OpenMP threads run the loops): pin OpenMP thread t to cpus[t % n], so two of them
 * never share a CPU while another sits idle. Returns the number of threads that failed. */
int lbd_bind_threads(const int *cpus, int n) {
    int failed = 0;
#pragma omp parallel reduction(+ : failed)
    failed += pin(cpus[omp_get_thread_num() % n]) != 0;
    return failed;
}
