/* The runtime's thread pool, one implementation for every compiled library that splits a call into units of work
 * (cpu_kernel.c, paged_decode.c). Included once into a library's translation unit, after its `job_t`, which must
 * have the fields
 *     void (*unit)(job_t *, int64_t);  int64_t units;  atomic_long next;
 * and, where the library keeps more than one pool, after `#define POOLS n` (default 1): each library has its own
 * pools, so a call into one never queues behind a call into another.
 *
 * dispatch() runs a job's units on the caller and up to threads - 1 others: torch's own OpenMP threads where the
 * library is built with -fopenmp, else (or in a forked child of a process that ran OpenMP regions) the pool's
 * threads, created once and asleep between calls. The caller holds pool->call.
 */
#ifndef VLM_POOL_H
#define VLM_POOL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#ifndef POOLS
#define POOLS 1
#endif

static void work(job_t *j) {
    for (;;) {
        const int64_t u = atomic_fetch_add(&j->next, 1);
        if (u >= j->units) break;
        j->unit(j, u);
    }
}

/* A persistent pool: threads are created once and sleep on a condition variable between calls (no
 * spinning, so they take nothing from torch's own threads in between). One call at a time uses a pool. */
typedef struct {
    pthread_mutex_t call, lock;
    pthread_cond_t start, done;
    int64_t threads, active;
    uint64_t generation;
    job_t *job;
    void *scratch; /* the calls' packed q, k and v, kept between calls up to SCRATCH_KEEP bytes */
    size_t scratch_bytes;
} pool_t;

#define POOL_INIT                                                                                              \
    {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER,    \
     0, 0, 0, NULL, NULL, 0}
static pool_t pools[POOLS] = {[0 ... POOLS - 1] = POOL_INIT};

/* NOTE: freed and allocated anew in every call, buffers of a few MB came back from the kernel as fresh pages to
 * be zeroed: 8 % of a loop of attention calls on a Xeon (clear_page_erms in perf). */
#define SCRATCH_KEEP ((size_t)64 << 20)

/* `bytes` of 64-byte aligned scratch for a call holding pool->call, or NULL. */
static __attribute__((unused)) void *scratch_get(pool_t *pool, size_t bytes) {
    if (bytes > pool->scratch_bytes) {
        free(pool->scratch);
        bytes = (bytes + 63) / 64 * 64;
        pool->scratch = aligned_alloc(64, bytes);
        pool->scratch_bytes = pool->scratch ? bytes : 0;
    }
    return pool->scratch;
}

/* After the call: a buffer past SCRATCH_KEEP goes back (one large batch should not pin its memory). */
static __attribute__((unused)) void scratch_done(pool_t *pool) {
    if (pool->scratch_bytes > SCRATCH_KEEP) {
        free(pool->scratch);
        pool->scratch = NULL;
        pool->scratch_bytes = 0;
    }
}

typedef struct {
    pool_t *pool;
    uint64_t seen;
} pool_arg_t;

static void *pool_thread(void *arg) {
    pool_t *pool = ((pool_arg_t *)arg)->pool;
    uint64_t seen = ((pool_arg_t *)arg)->seen;
    free(arg);
    pthread_mutex_lock(&pool->lock);
    for (;;) {
        while (pool->generation == seen) pthread_cond_wait(&pool->start, &pool->lock);
        seen = pool->generation;
        job_t *j = pool->job;
        pthread_mutex_unlock(&pool->lock);
        if (j) work(j);
        pthread_mutex_lock(&pool->lock);
        if (--pool->active == 0) pthread_cond_signal(&pool->done);
    }
    return NULL;
}

/* After fork() only the calling thread exists: the child starts with empty pools. */
static void pool_after_fork(void) {
    for (int i = 0; i < POOLS; i++) {
        pool_t *pool = &pools[i];
        pthread_mutex_init(&pool->call, NULL);
        pthread_mutex_init(&pool->lock, NULL);
        pthread_cond_init(&pool->start, NULL);
        pthread_cond_init(&pool->done, NULL);
        pool->threads = pool->active = 0;
        pool->job = NULL;
    }
}

static void register_after_fork(void) { pthread_atfork(NULL, NULL, pool_after_fork); }

static void pool_grow(pool_t *pool, int64_t want) {
    static pthread_once_t registered = PTHREAD_ONCE_INIT;
    pthread_once(&registered, register_after_fork);
    while (pool->threads < want) {
        pool_arg_t *arg = malloc(sizeof *arg);
        if (!arg) break;
        pthread_mutex_lock(&pool->lock);
        *arg = (pool_arg_t){pool, pool->generation};
        pthread_mutex_unlock(&pool->lock);
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int rc = pthread_create(&t, &attr, pool_thread, arg);
        pthread_attr_destroy(&attr);
        if (rc != 0) {
            free(arg);
            break;
        }
        pool->threads++;
    }
}

#ifdef _OPENMP
/* libgomp's team does not survive fork (a child waits on threads it does not have): in a child of a process
 * that ran this library's OpenMP regions, the calls go to the library's own pool instead. */
static atomic_int omp_ran, omp_unusable;
static void omp_after_fork(void) {
    if (atomic_load(&omp_ran)) atomic_store(&omp_unusable, 1);
}
static void register_omp_fork(void) { pthread_atfork(NULL, NULL, omp_after_fork); }
static int use_omp(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, register_omp_fork);
    if (atomic_load(&omp_unusable)) return 0;
    atomic_store(&omp_ran, 1);
    return 1;
}
#endif

/* Runs every unit of j on the caller and up to threads - 1 others: torch's OpenMP threads, or the pool's where
 * the library is built without OpenMP or runs in a forked child; the caller holds pool->call. */
static void dispatch(pool_t *pool, job_t *j, int64_t threads) {
    atomic_store(&j->next, 0);
    if (threads > j->units) threads = j->units;
    if (threads <= 1) {
        work(j);
        return;
    }
#ifdef _OPENMP
    /* On torch's own OpenMP threads (built with -fopenmp, this library binds to the libgomp torch loaded):
     * NOTE: on a pool of our own, the OpenMP workers torch's last parallel op left spinning (libgomp's
     * GOMP_SPINCOUNT, a few ms) took a core from our threads: a 768 → 1024 float32 linear of 1,024 rows right
     * after a torch call took 15.5 ms against 10.5 with GOMP_SPINCOUNT=10000 (2-vCPU Zen 3). */
    if (use_omp()) {
#pragma omp parallel num_threads((int)threads)
        work(j);
        return;
    }
#endif
    pool_grow(pool, threads - 1);
    pthread_mutex_lock(&pool->lock);
    pool->job = j;
    pool->active = pool->threads;
    pool->generation++;
    pthread_cond_broadcast(&pool->start);
    pthread_mutex_unlock(&pool->lock);
    work(j); /* the caller works too; pool threads beyond threads - 1 find no units left */
    pthread_mutex_lock(&pool->lock);
    while (pool->active > 0) pthread_cond_wait(&pool->done, &pool->lock);
    pool->job = NULL;
    pthread_mutex_unlock(&pool->lock);
}

#endif /* VLM_POOL_H */
