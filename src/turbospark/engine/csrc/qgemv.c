/* Few-row matmuls on quantized weights for x86 CPUs with AVX2 (turbospark.engine.native).
 *
 * torch's own int4 / int8 decode kernels widen every weight to float and multiply in float;
 * on an AVX2-only CPU that costs 4-5x the time it takes to read the weight. These kernels do
 * what llama.cpp does on such CPUs instead: each activation row is quantized to int8 in blocks
 * of 32 (one float scale per block), and blocks of weight codes meet blocks of activation codes
 * in 8-bit multiply-adds (vpmaddubsw), accumulated in int32 and scaled once per block. A weight
 * is read once for all the rows of a call, so a batch of a few decodes costs about one.
 *
 * Weights:
 * - q4: w = d * code + m, codes in [0, 15], fp16 d and m per block of 32 inputs, stored by
 *   groups of 8 output columns (`out` padded to a multiple of 8 with zero columns): per group
 *   and block, 128 bytes of codes, [j (4)][column (8)][i (4)], byte = code of input 4j + i in
 *   its low nibble and of input 16 + 4j + i in its high one; then d and m as (groups, blocks, 8)
 *   fp16. So one 32-byte load holds four inputs of each of the eight columns, a column to each
 *   32-bit lane, for a byte dot product against four inputs of an activation row broadcast
 *   (the layout llama.cpp's repacked x86 kernels use). `in` a multiple of 64.
 * - q8: w = scale * code, codes in [-127, 127], one float scale per output column; stored in
 *   the same groups of 8 columns: per group and block of 32 inputs 256 bytes, [j (8)][column
 *   (8)][i (4)], byte = code of input 4j + i plus 128 (unsigned); scales (out padded to 8).
 * Activations and outputs are float32, row-major; `in` is a multiple of 32.
 *
 * Threads: not OpenMP. An OpenMP parallel region ends in a barrier that waits for every thread
 * of the team, so when another process (or the server's own event loop) holds one of the two
 * cores, a step waits a scheduler time slice for the thread that is not running: decode steps
 * went from ~30 ms to 500+ ms on a shared 2-core machine. Here work is cut into chunks that
 * threads claim from a shared counter; the caller claims too, and waits only for chunks another
 * thread has actually started. A helper that is not scheduled claims nothing and costs nothing.
 * A helper descheduled in the middle of a chunk (the event loop or the client woke on its core)
 * would still hold the step until it ran again; so when the caller has nothing left to claim
 * and a helper has sat on one chunk for STEAL_AFTER_NS, the caller takes that chunk over: it
 * marks it stolen, signals the helper, and runs the chunk itself. Chunks only write their own
 * outputs, computed the same way by any thread, so a helper that finishes the chunk anyway
 * writes the same values. A helper that has not finished abandons it: the signal is delivered
 * before it runs another instruction of its own (a descheduled thread takes pending signals as
 * it comes back to user mode), and its handler jumps back to the helper's loop. The caller
 * leaves the job once the helper acknowledged, or after ABORT_WAIT_NS without an acknowledgement
 * (the helper is not running, and will abandon the chunk before touching anything).
 */
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define QK 32
#define MAX_ROWS 8

#define SCALE_GROUP 8 /* activation scale rows are padded to a multiple of this many blocks */
#define Q4_COLS 8       /* output columns of a q4 weight stored together (one group) */
#define Q4_GROUP_BYTES (Q4_COLS * QK / 2) /* one block of one group: 128 bytes of codes */
#define Q8_COLS 8 /* the same for q8 weights */
#define Q8_GROUP_BYTES (Q8_COLS * QK) /* 256 bytes */

static inline int padded_blocks(int k) { return (k / QK + SCALE_GROUP - 1) / SCALE_GROUP * SCALE_GROUP; }

/* x (rows, k) -> codes (rows, k) int8, per-block scales and per-block sums of x */
static void quantize_rows(const float *x, int rows, int k, int8_t *q, float *scale, float *sum, int32_t *isum) {
    const int nb = k / QK, nbp = padded_blocks(k);
    for (int r = 0; r < rows; r++) {
        for (int b = nb; b < nbp; b++) {
            scale[r * nbp + b] = sum[r * nbp + b] = 0.0f;
            isum[r * nbp + b] = 0;
        }
        for (int b = 0; b < nb; b++) {
            const float *xb = x + (size_t)r * k + b * QK;
            int8_t *qb = q + (size_t)r * k + b * QK;
            float amax = 0.0f;
            for (int i = 0; i < QK; i++) {
                float a = fabsf(xb[i]);
                amax = a > amax ? a : amax;
            }
            const float d = amax / 127.0f;
            const float id = d > 0.0f ? 1.0f / d : 0.0f;
            int s = 0;
            for (int i = 0; i < QK; i++) {
                qb[i] = (int8_t)lrintf(xb[i] * id);
                s += qb[i];
            }
            scale[r * nbp + b] = d;
            /* the sum of the quantized block, not of x: the offset term then sees the same
             * rounding as the codes, and the errors of the two terms cancel */
            sum[r * nbp + b] = d * (float)s;
            isum[r * nbp + b] = s;
        }
    }
}

static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

static inline float fp16(uint16_t h) { return _cvtsh_ss(h); }

typedef struct {
    int8_t *q;
    float *scale;
    float *sum;
    int32_t *isum; /* the integer sum of each block's codes */
} quantized;

/* room for `rows` activation rows of width up to k; -1 when out of memory (release() frees
 * whatever was allocated) */
static int quantized_alloc(int rows, int k, quantized *out) {
    const int nbp = padded_blocks(k);
    out->q = (int8_t *)aligned_alloc(64, ((size_t)rows * k + 63) / 64 * 64);
    out->scale = (float *)malloc(sizeof(float) * rows * nbp);
    out->sum = (float *)malloc(sizeof(float) * rows * nbp);
    out->isum = (int32_t *)malloc(sizeof(int32_t) * rows * nbp);
    return out->q && out->scale && out->sum && out->isum ? 0 : -1;
}

static int quantize(const float *x, int rows, int k, quantized *out) {
    if (quantized_alloc(rows, k, out)) return -1;
    quantize_rows(x, rows, k, out->q, out->scale, out->sum, out->isum);
    return 0;
}

static void release(quantized *qx) {
    free(qx->q);
    free(qx->scale);
    free(qx->sum);
    free(qx->isum);
}


/* ---- the work-claiming pool ---- */

#define MAX_HELPERS 63
#define SPIN_NS 200000        /* a helper spins this long for the next job before it sleeps */
#define STEAL_AFTER_NS 30000  /* a chunk takes a few microseconds: one held this long is stalled */
#define ABORT_WAIT_NS 50000   /* how long a running helper may take to see the abort signal */
#define SLOT_IDLE UINT64_MAX
#define SLOT_STOLEN (UINT64_MAX - 1)

typedef void (*chunk_fn)(void *ctx, int chunk);

static struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int helpers;                  /* threads started (they live as long as the process) */
    atomic_uint_fast64_t claim;   /* job generation << 32 | next chunk to claim */
    atomic_int done;              /* chunks of the current job finished */
    atomic_int sleeping;          /* helpers blocked on `wake` */
    /* the current job: written before its generation is published */
    chunk_fn fn;
    void *ctx;
    int chunks;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, NULL, NULL, 0};

/* one per helper: the chunk it runs, so the caller can take it over */
typedef struct {
    _Alignas(64) atomic_uint_fast64_t running; /* generation << 32 | chunk, SLOT_IDLE or SLOT_STOLEN */
    atomic_int tid;
    sigjmp_buf resume; /* where the abort signal's handler sends a helper whose chunk was taken */
} helper_slot;

static helper_slot slots[MAX_HELPERS];
static int abort_signal;      /* 0: the signal already had a handler, chunks are never taken over */
static atomic_int stealing = 1; /* chunks may be taken over (set on load: ts_pool_set_stealing) */
static atomic_long num_steals; /* chunks the caller took over, for tests and diagnostics */
static atomic_int stall_test_ns; /* tests only: helpers sleep this long in every third chunk */

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static void on_abort(int sig) {
    (void)sig;
    const int tid = (int)syscall(SYS_gettid);
    for (int i = 0; i < MAX_HELPERS; i++) {
        helper_slot *h = &slots[i];
        if (atomic_load(&h->tid) != tid) continue;
        uint_fast64_t stolen = SLOT_STOLEN;
        /* the chunk this helper runs was taken over: drop it; else a late signal, ignored */
        if (atomic_compare_exchange_strong(&h->running, &stolen, SLOT_IDLE)) siglongjmp(h->resume, 1);
        return;
    }
}

/* the abort signal's handler, once, unless the signal already has one */
static void install_abort_signal(void) {
    const int sig = SIGRTMIN + 4;
    struct sigaction old;
    if (sig > SIGRTMAX || sigaction(sig, NULL, &old) != 0 || old.sa_handler != SIG_DFL) return;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_abort;
    sa.sa_flags = SA_NODEFER; /* left by a jump, not a return: keep it unblocked */
    sigemptyset(&sa.sa_mask);
    if (sigaction(sig, &sa, NULL) == 0) abort_signal = sig;
}

static void stall_for_test(int chunk) {
    const int ns = atomic_load_explicit(&stall_test_ns, memory_order_relaxed);
    if (ns > 0 && chunk % 3 == 0) {
        struct timespec t = {0, ns};
        nanosleep(&t, NULL);
    }
}

/* claims and runs chunks of job `gen` until none is left (or the job is another one); `me` is
 * the helper's slot, NULL for the caller */
static void run_chunks(uint32_t gen, chunk_fn fn, void *ctx, int chunks, helper_slot *me) {
    for (;;) {
        uint64_t v = atomic_load_explicit(&pool.claim, memory_order_acquire);
        if ((uint32_t)(v >> 32) != gen || (int)(uint32_t)v >= chunks) return;
        if (!atomic_compare_exchange_weak_explicit(&pool.claim, &v, v + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        const int chunk = (int)(uint32_t)v;
        if (!me) {
            fn(ctx, chunk);
            atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
            continue;
        }
        atomic_store_explicit(&me->running, (uint64_t)gen << 32 | (uint32_t)chunk, memory_order_release);
        stall_for_test(chunk);
        fn(ctx, chunk);
        /* taken over meanwhile: the caller counts it */
        if (atomic_exchange_explicit(&me->running, SLOT_IDLE, memory_order_acq_rel) != SLOT_STOLEN)
            atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
    }
}

static void *helper_main(void *arg) {
    helper_slot *me = (helper_slot *)arg;
    atomic_store(&me->tid, (int)syscall(SYS_gettid));
    if (abort_signal) {
        sigset_t set;
        sigemptyset(&set);
        sigaddset(&set, abort_signal);
        pthread_sigmask(SIG_UNBLOCK, &set, NULL);
    }
    volatile uint32_t seen = (uint32_t)(atomic_load(&pool.claim) >> 32);
    /* a chunk taken over lands here (from the abort handler): back to waiting for work */
    sigsetjmp(me->resume, 0);
    for (;;) {
        uint64_t start = now_ns();
        uint32_t gen;
        int polls = 0;
        for (;;) { /* spin for a while: decode steps come back-to-back */
            gen = (uint32_t)(atomic_load_explicit(&pool.claim, memory_order_acquire) >> 32);
            if (gen != seen) break;
            _mm_pause();
            if (++polls % 256 == 0 && now_ns() - start > SPIN_NS) {
                pthread_mutex_lock(&pool.lock);
                atomic_fetch_add(&pool.sleeping, 1);
                while ((uint32_t)(atomic_load(&pool.claim) >> 32) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
                atomic_fetch_sub(&pool.sleeping, 1);
                pthread_mutex_unlock(&pool.lock);
                start = now_ns();
            }
        }
        seen = gen;
        pthread_mutex_lock(&pool.lock); /* the job's fields as published with `gen` */
        chunk_fn fn = pool.fn;
        void *ctx = pool.ctx;
        int chunks = pool.chunks;
        pthread_mutex_unlock(&pool.lock);
        run_chunks(gen, fn, ctx, chunks, me);
    }
    return NULL;
}

/* the caller, with nothing left to claim: takes over every chunk of job `gen` a helper still
 * holds, and counts each once it has run it */
static void take_over_stalled(uint32_t gen, chunk_fn fn, void *ctx) {
    for (int i = 0; i < pool.helpers; i++) {
        helper_slot *h = &slots[i];
        uint_fast64_t v = atomic_load_explicit(&h->running, memory_order_acquire);
        if (v == SLOT_IDLE || v == SLOT_STOLEN || (uint32_t)(v >> 32) != gen) continue;
        if (!atomic_compare_exchange_strong(&h->running, &v, SLOT_STOLEN)) continue; /* it finished */
        const int signalled = syscall(SYS_tgkill, (int)getpid(), atomic_load(&h->tid), abort_signal) == 0;
        fn(ctx, (int)(uint32_t)v);
        atomic_fetch_add_explicit(&num_steals, 1, memory_order_relaxed);
        /* a running helper acknowledges within microseconds (it finished, or its handler ran);
         * one that does not is not running, and drops the chunk before it runs again. Without
         * the signal (it could not be queued) the helper has to finish the chunk: wait for it */
        const uint64_t sent = now_ns();
        while (atomic_load_explicit(&h->running, memory_order_acquire) == SLOT_STOLEN &&
               (!signalled || now_ns() - sent < ABORT_WAIT_NS))
            _mm_pause();
        atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
    }
}

static pthread_mutex_t pool_owner = PTHREAD_MUTEX_INITIALIZER;

/* runs fn(ctx, 0 .. chunks - 1) on up to `threads` threads, the caller one of them. The pool
 * serves one caller at a time (an engine thread); a second caller meanwhile (another model's
 * engine) runs its chunks on its own thread rather than wait. `fn` must write only outputs of
 * its own chunk, the same whichever thread runs it (a chunk may run twice, see the top). */
static void parallel_chunks(chunk_fn fn, void *ctx, int chunks, int threads) {
    if (threads > MAX_HELPERS + 1) threads = MAX_HELPERS + 1;
    if (threads <= 1 || chunks <= 1 || pthread_mutex_trylock(&pool_owner) != 0) {
        for (int c = 0; c < chunks; c++) fn(ctx, c);
        return;
    }
    pthread_mutex_lock(&pool.lock);
    if (pool.helpers == 0) install_abort_signal();
    while (pool.helpers < threads - 1) {
        pthread_t t;
        atomic_store(&slots[pool.helpers].running, SLOT_IDLE); /* nothing to take over before it runs */
        if (pthread_create(&t, NULL, helper_main, &slots[pool.helpers]) != 0) break;
        pthread_detach(t);
        pool.helpers++;
    }
    uint32_t gen = (uint32_t)(atomic_load(&pool.claim) >> 32) + 1;
    pool.fn = fn;
    pool.ctx = ctx;
    pool.chunks = chunks;
    atomic_store(&pool.done, 0);
    atomic_store_explicit(&pool.claim, (uint64_t)gen << 32, memory_order_release);
    if (atomic_load(&pool.sleeping) > 0) pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    run_chunks(gen, fn, ctx, chunks, NULL);
    /* every chunk is claimed; wait for those a helper is still running, and take over those
     * it holds too long */
    uint64_t waiting_since = 0;
    int polls = 0;
    while (atomic_load_explicit(&pool.done, memory_order_acquire) < chunks) {
        _mm_pause();
        if (!abort_signal || ++polls % 64 || !atomic_load_explicit(&stealing, memory_order_relaxed)) continue;
        const uint64_t t = now_ns();
        if (!waiting_since) {
            waiting_since = t;
        } else if (t - waiting_since > STEAL_AFTER_NS) {
            take_over_stalled(gen, fn, ctx);
            waiting_since = 0;
        }
    }
    pthread_mutex_unlock(&pool_owner);
}

/* chunks taken over from a stalled helper since the process started */
long ts_pool_steals(void) { return atomic_load(&num_steals); }

/* turns taking chunks over on (1) or off (0); returns the previous setting. The loader calls it
 * with the process's pool_steal setting (turbospark.engine.kernel_settings) */
int ts_pool_set_stealing(int on) { return atomic_exchange(&stealing, on ? 1 : 0); }

/* tests only: helpers sleep `ns` in every third chunk they run (0: never) */
void ts_pool_test_stall(int ns) { atomic_store(&stall_test_ns, ns); }

#define INLINE static inline __attribute__((always_inline))

/* Byte dot products: unsigned x signed bytes summed four to an int32 lane. With AVX-512 VNNI
 * (built with -mavx512vnni -mavx512vl where the CPU has them) one vpdpbusd, which also adds into
 * its accumulator; else vpmaddubsw (pairs to int16) and vpmaddwd against ones. Both builds reach
 * the same integer sums (see q4_group and q8_group for why no int16 step saturates). */

/* Activation rows as the dot products read them: codes (rows, k), per-block scales and sums
 * (rows, k / 32), through restrict pointers so the compiler keeps them in registers. */
typedef struct {
    const int8_t *restrict q;
    const float *restrict scale;
    const float *restrict sum;
    const int32_t *restrict isum;
    int k, nb, nbp; /* width, blocks, blocks padded (the stride of scale and sum) */
} xrows;

#ifdef __AVX512VNNI__
/* one block of a group against one activation row: eight vpdpbusd, each four bytes of the row
 * (broadcast) against four inputs of the eight columns, in two chains of four */
INLINE __m256i dot8_vnni(const __m256i *w, const int32_t *xr) {
    __m256i s0 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w[0], _mm256_set1_epi32(xr[0]));
    __m256i s1 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w[4], _mm256_set1_epi32(xr[4]));
    for (int j = 1; j < 4; j++) {
        s0 = _mm256_dpbusd_epi32(s0, w[j], _mm256_set1_epi32(xr[j]));
        s1 = _mm256_dpbusd_epi32(s1, w[j + 4], _mm256_set1_epi32(xr[j + 4]));
    }
    return _mm256_add_epi32(s0, s1);
}
#endif

/* Eight output columns of a q4 weight (one group, see the layout at the top) against `ROWS`
 * activation rows. Each 32-bit lane of a register holds one column, so per block and row eight
 * byte dot products (each: four inputs of all eight columns against those four inputs of the
 * row, broadcast) sum into one int32 vector, which is scaled by the eight columns' scales times
 * the row's block scale in one FMA, and the offset term is a second FMA; no horizontal sums. The
 * block's codes are loaded and split into nibbles once for all rows. Each row's arithmetic is the
 * same whatever ROWS is: a row's outputs do not depend on the call's row count. */
INLINE void q4_group(const uint8_t *restrict codes, const uint16_t *restrict d16, const uint16_t *restrict m16,
                     xrows x, const int ROWS, __m256 *acc, __m256 *macc) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
#ifndef __AVX512VNNI__
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    for (int r = 0; r < ROWS; r++) acc[r] = macc[r] = _mm256_setzero_ps();
    for (int b = 0; b < x.nb; b++) {
        const uint8_t *cb = codes + (size_t)b * Q4_GROUP_BYTES;
        __m256i w[8];
        for (int j = 0; j < 4; j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(cb + 32 * j));
            w[j] = _mm256_and_si256(v, low4);
            w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        }
        const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d16 + (size_t)b * Q4_COLS)));
        const __m256 m8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m16 + (size_t)b * Q4_COLS)));
        for (int r = 0; r < ROWS; r++) {
            const int32_t *xr = (const int32_t *)(x.q + (size_t)r * x.k + (size_t)b * QK);
#ifdef __AVX512VNNI__
            const __m256i s = dot8_vnni(w, xr);
#else
            /* pairs of u4 x s8 products in int16: at most 2 * 15 * 128 per pair, so eight of them
             * summed stay below 2^15 */
            __m256i p = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(xr[0]));
            for (int j = 1; j < 8; j++) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[j], _mm256_set1_epi32(xr[j])));
            const __m256i s = _mm256_madd_epi16(p, ones);
#endif
            const __m256 scale = _mm256_mul_ps(d8, _mm256_set1_ps(x.scale[r * x.nbp + b]));
            acc[r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(s), acc[r]);
            macc[r] = _mm256_fmadd_ps(m8, _mm256_set1_ps(x.sum[r * x.nbp + b]), macc[r]);
        }
    }
}

/* Eight output columns of a q8 weight (one group, see the layout at the top) against `ROWS`
 * activation rows, unscaled (the caller applies the column scales): as `q4_group`, a column to
 * each lane. The codes are stored as w + 128 (unsigned) for VNNI's unsigned x signed product,
 * whose sums then carry 128 times the row's block sum, taken off in int32. Without VNNI the
 * codes go back to signed once per block and each row takes |w| x (x with w's sign) in pairs.
 * Both give every block's exact integer sum, so both builds write the same floats. */
INLINE void q8_group(const uint8_t *restrict codes, xrows x, const int ROWS, __m256 *acc) {
#ifndef __AVX512VNNI__
    const __m256i ones = _mm256_set1_epi16(1), bias = _mm256_set1_epi8((char)0x80);
#endif
    for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < x.nb; b++) {
        const uint8_t *cb = codes + (size_t)b * Q8_GROUP_BYTES;
        __m256i w[8];
#ifdef __AVX512VNNI__
        for (int j = 0; j < 8; j++) w[j] = _mm256_loadu_si256((const __m256i *)(cb + 32 * j));
#else
        __m256i wabs[8];
        for (int j = 0; j < 8; j++) {
            w[j] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(cb + 32 * j)), bias);
            wabs[j] = _mm256_sign_epi8(w[j], w[j]);
        }
#endif
        for (int r = 0; r < ROWS; r++) {
            const int32_t *xr = (const int32_t *)(x.q + (size_t)r * x.k + (size_t)b * QK);
            const int at = r * x.nbp + b;
#ifdef __AVX512VNNI__
            const __m256i s = _mm256_sub_epi32(dot8_vnni(w, xr), _mm256_set1_epi32(128 * x.isum[at]));
#else
            __m256i s = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) {
                const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(xr[j]), w[j]);
                s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(wabs[j], xs), ones));
            }
#endif
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(x.scale[at]), _mm256_cvtepi32_ps(s), acc[r]);
        }
    }
}

/* a switch over the row count, so each case is compiled with ROWS constant: loops over rows
 * unrolled and the accumulators kept in registers */
#define FOR_ROWS(rows, CALL) \
    switch (rows) {          \
    case 1: CALL(1); break;  \
    case 2: CALL(2); break;  \
    case 3: CALL(3); break;  \
    case 4: CALL(4); break;  \
    case 5: CALL(5); break;  \
    case 6: CALL(6); break;  \
    case 7: CALL(7); break;  \
    default: CALL(8); break; \
    }

typedef struct {
    const quantized *qx;
    const void *w;       /* q4: codes; q8: int8 codes */
    const uint16_t *d16; /* q4: fp16 scales and offsets (groups, blocks, 8) */
    const uint16_t *m16;
    const float *scales; /* q8: per output row */
    const float *bias;
    float *y;
    int rows, k, n;
    float *best;      /* when set: each chunk's largest output per row, (chunks, rows) */
    int64_t *best_at; /* and its column */
} matmul_job;

/* numpy's argmax order: a NaN beats everything (the first NaN wins), else the larger value; ties
 * keep the earlier column, so scanning columns in order gives the first maximum */
static inline int beats(float v, float best) { return isnan(v) ? !isnan(best) : v > best; }

#define ROWS_PER_CHUNK 32

static xrows rows_of(const quantized *qx, int k) {
    const xrows x = {qx->q, qx->scale, qx->sum, qx->isum, k, k / QK, padded_blocks(k)};
    return x;
}

static void q4_chunk(void *arg, int chunk) {
    const matmul_job *j = (const matmul_job *)arg;
    const xrows x = rows_of(j->qx, j->k);
    const int end = (chunk + 1) * ROWS_PER_CHUNK < j->n ? (chunk + 1) * ROWS_PER_CHUNK : j->n;
    for (int o = chunk * ROWS_PER_CHUNK; o < end; o += Q4_COLS) {
        const size_t g = (size_t)o / Q4_COLS;
        __m256 acc[MAX_ROWS], macc[MAX_ROWS];
#define Q4(R)                                                                                                   \
    q4_group((const uint8_t *)j->w + g * x.nb * Q4_GROUP_BYTES, j->d16 + g * x.nb * Q4_COLS,                      \
             j->m16 + g * x.nb * Q4_COLS, x, R, acc, macc)
        FOR_ROWS(j->rows, Q4)
        const int cols = end - o < Q4_COLS ? end - o : Q4_COLS;
        for (int r = 0; r < j->rows; r++) {
            float out[Q4_COLS];
            _mm256_storeu_ps(out, _mm256_add_ps(acc[r], macc[r]));
            for (int c = 0; c < cols; c++) j->y[(size_t)r * j->n + o + c] = out[c] + (j->bias ? j->bias[o + c] : 0.0f);
        }
    }
}

static void q8_chunk(void *arg, int chunk) {
    const matmul_job *j = (const matmul_job *)arg;
    const xrows x = rows_of(j->qx, j->k);
    const int start = chunk * ROWS_PER_CHUNK;
    const int end = (chunk + 1) * ROWS_PER_CHUNK < j->n ? (chunk + 1) * ROWS_PER_CHUNK : j->n;
    const int track = j->best != NULL; /* only the lm_head's greedy steps ask: the layers do not */
    float best[MAX_ROWS];
    int64_t best_at[MAX_ROWS];
    for (int o = start; o < end; o += Q8_COLS) {
        const size_t g = (size_t)o / Q8_COLS;
        __m256 acc[MAX_ROWS];
#define Q8(R) q8_group((const uint8_t *)j->w + g * x.nb * Q8_GROUP_BYTES, x, R, acc)
        FOR_ROWS(j->rows, Q8)
        const int cols = end - o < Q8_COLS ? end - o : Q8_COLS;
        for (int r = 0; r < j->rows; r++) {
            float out[Q8_COLS];
            _mm256_storeu_ps(out, acc[r]);
            for (int c = 0; c < cols; c++) {
                const float v = out[c] * j->scales[o + c] + (j->bias ? j->bias[o + c] : 0.0f);
                j->y[(size_t)r * j->n + o + c] = v;
                if (track && ((o == start && c == 0) || beats(v, best[r]))) {
                    best[r] = v;
                    best_at[r] = o + c;
                }
            }
        }
    }
    if (track)
        for (int r = 0; r < j->rows; r++) {
            j->best[(size_t)chunk * j->rows + r] = best[r];
            j->best_at[(size_t)chunk * j->rows + r] = best_at[r];
        }
}

static int quantized_matmul(chunk_fn fn, const float *x, int rows, int k, const void *w, const uint16_t *d16,
                            const uint16_t *m16, const float *scales, int n, const float *bias, float *y,
                            int64_t *argmax, int threads) {
    if (rows < 1 || rows > MAX_ROWS || k % QK || (d16 && k % (2 * QK)) || n < 1) return -1;
    const int chunks = (n + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK;
    quantized qx;
    if (quantize(x, rows, k, &qx)) {
        release(&qx);
        return -1;
    }
    matmul_job job = {&qx, w, d16, m16, scales, bias, y, rows, k, n, NULL, NULL};
    if (argmax) { /* each chunk keeps its rows' maxima as it writes them: no second read of y */
        job.best = malloc(sizeof(float) * (size_t)chunks * rows);
        job.best_at = malloc(sizeof(int64_t) * (size_t)chunks * rows);
        if (!job.best || !job.best_at) {
            free(job.best);
            free(job.best_at);
            release(&qx);
            return -1;
        }
    }
    parallel_chunks(fn, &job, chunks, threads);
    release(&qx);
    if (argmax) {
        for (int r = 0; r < rows; r++) { /* chunks in column order: the first maximum wins */
            float best = job.best[r];
            int64_t at = job.best_at[r];
            for (int c = 1; c < chunks; c++)
                if (beats(job.best[(size_t)c * rows + r], best)) {
                    best = job.best[(size_t)c * rows + r];
                    at = job.best_at[(size_t)c * rows + r];
                }
            argmax[r] = at;
        }
        free(job.best);
        free(job.best_at);
    }
    return 0;
}

/* y (rows, n) = x (rows, k) @ w.T (+ bias); returns 0, or -1 when rows or memory is out of range */
int ts_q4_matmul(const float *x, int rows, int k, const uint8_t *codes, const uint16_t *d16, const uint16_t *m16,
                 int n, const float *bias, float *y, int threads) {
    return quantized_matmul(q4_chunk, x, rows, k, codes, d16, m16, NULL, n, bias, y, NULL, threads);
}

/* y (rows, n) = (x (rows, k) @ w.T) * scales (+ bias), w a q8 weight (n, k) in the group layout */
int ts_q8_matmul(const float *x, int rows, int k, const uint8_t *w, const float *scales, int n,
                 const float *bias, float *y, int threads) {
    return quantized_matmul(q8_chunk, x, rows, k, w, NULL, NULL, scales, n, bias, y, NULL, threads);
}

/* the same, and argmax (rows) int64: each row's column of its largest output, as numpy's argmax
 * of y would give it (the first maximum; a NaN counts as the largest) */
int ts_q8_matmul_argmax(const float *x, int rows, int k, const uint8_t *w, const float *scales, int n,
                        const float *bias, float *y, int64_t *argmax, int threads) {
    return quantized_matmul(q8_chunk, x, rows, k, w, NULL, NULL, scales, n, bias, y, argmax, threads);
}

/* ---- a q8 weight widened back to (n, k) rows, for the many-row matmuls that expand it ---- */

typedef struct {
    const uint8_t *codes;
    const float *scales;
    void *out;
    int n, k, bf16;
} expand_job;

#define EXPAND_GROUPS_PER_CHUNK 4

/* round to nearest even, as torch converts float32 to bfloat16 (finite values) */
static inline __m128i to_bf16(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i packed = _mm256_packus_epi32(rounded, rounded); /* 16-bit halves, lanes 0-3 and 4-7 */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

/* an 8 x 8 matrix of 32-bit elements, one row per register, transposed in place */
static inline void transpose8(__m256i *r) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
    }
}

static void expand_chunk(void *arg, int chunk) {
    const expand_job *j = (const expand_job *)arg;
    const int nb = j->k / QK;
    const __m256i bias = _mm256_set1_epi8((char)0x80);
    const int groups = (j->n + Q8_COLS - 1) / Q8_COLS;
    const int g_end = (chunk + 1) * EXPAND_GROUPS_PER_CHUNK < groups ? (chunk + 1) * EXPAND_GROUPS_PER_CHUNK : groups;
    for (int g = chunk * EXPAND_GROUPS_PER_CHUNK; g < g_end; g++) {
        const int cols = j->n - g * Q8_COLS < Q8_COLS ? j->n - g * Q8_COLS : Q8_COLS;
        for (int b = 0; b < nb; b++) {
            /* row jj: 4 codes of each column; transposed, row c: column c's 32 codes in order */
            const uint8_t *cb = j->codes + ((size_t)g * nb + b) * Q8_GROUP_BYTES;
            __m256i r[8];
            for (int jj = 0; jj < 8; jj++) r[jj] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(cb + 32 * jj)), bias);
            transpose8(r);
            for (int c = 0; c < cols; c++) {
                const size_t o = (size_t)g * Q8_COLS + c;
                const __m256 scale = _mm256_set1_ps(j->scales[o]);
                for (int q = 0; q < 4; q++) {
                    const __m128i eight = _mm_cvtsi64_si128(_mm256_extract_epi64(r[c], q));
                    const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight)), scale);
                    const size_t at = o * j->k + (size_t)b * QK + 8 * q;
                    if (j->bf16)
                        _mm_storeu_si128((__m128i *)((uint16_t *)j->out + at), to_bf16(v));
                    else
                        _mm256_storeu_ps((float *)j->out + at, v);
                }
            }
        }
    }
}

/* out (n, k) = the q8 weight's codes times their column scales, float32 or (bf16 = 1) bfloat16:
 * what a many-row matmul multiplies by, from the one layout the weight is kept in */
int ts_q8_expand(const uint8_t *codes, const float *scales, int n, int k, void *out, int bf16, int threads) {
    if (n < 1 || k % QK) return -1;
    expand_job job = {codes, scales, out, n, k, bf16};
    const int groups = (n + Q8_COLS - 1) / Q8_COLS;
    parallel_chunks(expand_chunk, &job, (groups + EXPAND_GROUPS_PER_CHUNK - 1) / EXPAND_GROUPS_PER_CHUNK, threads);
    return 0;
}

/* ---- the rest of a decode step, for few rows: each replaces several torch ops ---- */

/* e^x for 8 floats: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-6 polynomial (Cephes'
 * coefficients for expf), 2^n through the exponent bits; relative error ~1e-7 */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float dot_f32(const float *a, const float *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* y = rms_norm(x + residual) * w per row of d; with `residual`, x + residual is also written
 * to `summed` (the residual stream's next value) */
void ts_rms_norm(const float *x, const float *residual, float *summed, const float *w, float eps, int rows, int d,
                 float *y) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * d;
        if (residual) {
            float *sr = summed + (size_t)r * d;
            const float *rr = residual + (size_t)r * d;
            for (int i = 0; i < d; i++) sr[i] = xr[i] + rr[i];
            xr = sr;
        }
        const float inv = 1.0f / sqrtf(dot_f32(xr, xr, d) / (float)d + eps);
        float *yr = y + (size_t)r * d;
        for (int i = 0; i < d; i++) yr[i] = xr[i] * inv * w[i];
    }
}

/* y (rows, inter) = silu(gate) * up for gate_up (rows, 2 * inter) */
void ts_silu_mul(const float *gate_up, int rows, int inter, float *y) {
    for (int r = 0; r < rows; r++) {
        const float *g = gate_up + (size_t)r * 2 * inter;
        const float *u = g + inter;
        float *yr = y + (size_t)r * inter;
        int i = 0;
        for (; i + 8 <= inter; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
        }
        for (; i < inter; i++) yr[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* one head of hd values: y = x * cos + roll(x, half) * sin (y must not alias x) */
static inline void rotate_head(const float *x, float *y, int hd, const float *c, const float *s) {
    const int half = hd / 2;
    for (int i = 0; i < half; i++) y[i] = x[i] * c[i] + x[i + half] * s[i];
    for (int i = half; i < hd; i++) y[i] = x[i] * c[i] + x[i - half] * s[i];
}

/* y = x * cos + roll(x, half) * sin per head ("rotate half" with the sign folded into sin);
 * x (tokens, heads, hd) with rows of `x_stride` floats per token, cos / sin (tokens, hd) */
void ts_rotary(const float *x, int tokens, int heads, int hd, int x_stride, const float *cos_t, const float *sin_t,
               float *y) {
    for (int t = 0; t < tokens; t++) {
        const float *c = cos_t + (size_t)t * hd, *s = sin_t + (size_t)t * hd;
        for (int h = 0; h < heads; h++)
            rotate_head(x + (size_t)t * x_stride + (size_t)h * hd, y + ((size_t)t * heads + h) * hd, hd, c, s);
    }
}

/* Attention of one new token per sequence over its cached keys and values, split like flash
 * decoding: each chunk is one (sequence, kv head, run of up to PART_SLOTS context slots) and
 * leaves, for each query head of the kv head's group, its running max, sum of exponentials and
 * weighted sum of values; the caller merges the parts. Parts keep two threads busy when there
 * are fewer kv heads than threads, or an odd count, and every key is read once. */
#define PART_SLOTS 256
#define MAX_GROUP 64
#define MAX_HEAD_DIM 256

typedef struct {
    const float *q;
    const void *k_cache, *v_cache; /* float32, or float16 when kv_f16 */
    int64_t num_slots;
    const int64_t *slot_ids;
    const int64_t *offsets;
    int64_t q_stride; /* floats from one sequence's q row to the next */
    int heads, kv_heads, hd, kv_f16;
    float scale;
    const int *part_seq, *part_head; /* per chunk */
    const int64_t *part_start, *part_end;
    float *partial; /* per chunk: group x (max, sum, hd values) */
} attention_job;

/* 8 cache values from p (float32, or float16 when F16) as floats */
INLINE __m256 load8(const void *p, size_t i, const int F16) {
    if (F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    return _mm256_loadu_ps((const float *)p + i);
}

INLINE float load1(const void *p, size_t i, const int F16) {
    return F16 ? fp16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* q . k for one cache row k (element offset `at`) */
INLINE float dot_kv(const float *q, const void *k, size_t at, int hd, const int F16) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= hd; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k, at + i, F16), acc);
    float sum = hsum(acc);
    for (; i < hd; i++) sum += q[i] * load1(k, at + i, F16);
    return sum;
}

/* the dot products of q with eight cache rows at element offsets at[0..7] (hd a multiple of 8):
 * eight independent FMA chains, then one transposing reduction instead of eight horizontal sums */
INLINE __m256 dot8(const float *q, const void *k, const size_t *at, int hd, const int F16) {
    __m256 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    for (int d = 0; d < hd; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(qv, load8(k, at[i] + d, F16), acc[i]);
    }
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    /* t0 = [k0..k3 low halves | k0..k3 high halves], t1 the same for k4..k7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

INLINE void attention_part(const attention_job *j, int chunk, const int F16) {
    const int s = j->part_seq[chunk], kh = j->part_head[chunk], hd = j->hd;
    const int group = j->heads / j->kv_heads;
    const int64_t a = j->part_start[chunk], b = j->part_end[chunk];
    const int64_t *ids = j->slot_ids + j->offsets[s];
    const size_t base = (size_t)kh * j->num_slots * hd; /* this kv head's first element */
    float p[PART_SLOTS];
    const int n = (int)(b - a);
    for (int g = 0; g < group; g++) {
        const float *qh = j->q + (size_t)s * j->q_stride + (size_t)(kh * group + g) * hd;
        float *res = j->partial + ((size_t)chunk * group + g) * (hd + 2);
        int t = 0;
        if (hd % 8 == 0)
            for (; t + 8 <= n; t += 8) {
                size_t at[8];
                for (int i = 0; i < 8; i++) at[i] = base + (size_t)ids[a + t + i] * hd;
                _mm256_storeu_ps(p + t, _mm256_mul_ps(dot8(qh, j->k_cache, at, hd, F16), _mm256_set1_ps(j->scale)));
            }
        for (; t < n; t++) p[t] = dot_kv(qh, j->k_cache, base + (size_t)ids[a + t] * hd, hd, F16) * j->scale;
        float mx = -INFINITY;
        for (t = 0; t < n; t++) mx = p[t] > mx ? p[t] : mx;
        __m256 tot8 = _mm256_setzero_ps();
        int i = 0;
        for (; i + 8 <= n; i += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + i), _mm256_set1_ps(mx)));
            _mm256_storeu_ps(p + i, e);
            tot8 = _mm256_add_ps(tot8, e);
        }
        float total = hsum(tot8);
        for (; i < n; i++) {
            p[i] = expf(p[i] - mx);
            total += p[i];
        }
        res[0] = mx;
        res[1] = total;
        float *o = res + 2;
        if (hd % 64 == 0) {
            /* 64 output dims at a time in eight registers, over every slot of the part */
            for (int d0 = 0; d0 < hd; d0 += 64) {
                __m256 acc[8];
                for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
                for (int u = 0; u < n; u++) {
                    const size_t vt = base + (size_t)ids[a + u] * hd + d0;
                    const __m256 pu = _mm256_set1_ps(p[u]);
                    for (int r = 0; r < 8; r++) acc[r] = _mm256_fmadd_ps(pu, load8(j->v_cache, vt + 8 * r, F16), acc[r]);
                }
                for (int r = 0; r < 8; r++) _mm256_storeu_ps(o + d0 + 8 * r, acc[r]);
            }
        } else {
            for (int d = 0; d < hd; d++) o[d] = 0.0f;
            for (int u = 0; u < n; u++) {
                const size_t vt = base + (size_t)ids[a + u] * hd;
                for (int d = 0; d < hd; d++) o[d] += p[u] * load1(j->v_cache, vt + d, F16);
            }
        }
    }
}

static void attention_chunk(void *arg, int chunk) {
    const attention_job *j = (const attention_job *)arg;
    if (j->kv_f16)
        attention_part(j, chunk, 1);
    else
        attention_part(j, chunk, 0);
}

/* q (seqs, heads, hd) with rows `q_stride` floats apart; k_cache / v_cache (kv_heads, slots, hd);
 * sequence s reads the slots slot_ids[offsets[s] .. offsets[s + 1]). out (seqs, heads, hd).
 * Returns -1 when out of memory or past the sizes it handles. */
static int attention(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache, int kv_f16,
                     int64_t num_slots, const int64_t *slot_ids, const int64_t *offsets, int seqs, int heads,
                     int kv_heads, int hd, float scale, float *out, int threads) {
    const int group = heads / kv_heads;
    if (group > MAX_GROUP || hd > MAX_HEAD_DIM || group * kv_heads != heads) return -1;
    int64_t chunks = 0;
    for (int s = 0; s < seqs; s++) chunks += kv_heads * ((offsets[s + 1] - offsets[s] + PART_SLOTS - 1) / PART_SLOTS);
    int *part_seq = (int *)malloc(sizeof(int) * 2 * (chunks + 1));
    int64_t *part_range = (int64_t *)malloc(sizeof(int64_t) * 2 * (chunks + 1));
    float *partial = (float *)malloc(sizeof(float) * (chunks + 1) * group * (hd + 2));
    if (!part_seq || !part_range || !partial) {
        free(part_seq);
        free(part_range);
        free(partial);
        return -1;
    }
    int *part_head = part_seq + chunks + 1;
    int64_t *part_start = part_range, *part_end = part_range + chunks + 1;
    int64_t c = 0;
    for (int s = 0; s < seqs; s++) {
        const int64_t len = offsets[s + 1] - offsets[s];
        for (int kh = 0; kh < kv_heads; kh++)
            for (int64_t a = 0; a < len; a += PART_SLOTS, c++) {
                part_seq[c] = s;
                part_head[c] = kh;
                part_start[c] = a;
                part_end[c] = a + PART_SLOTS < len ? a + PART_SLOTS : len;
            }
    }
    attention_job job = {q,         k_cache,   v_cache,    num_slots, slot_ids, offsets, q_stride, heads, kv_heads,
                         hd,        kv_f16,    scale,      part_seq,  part_head, part_start, part_end, partial};
    parallel_chunks(attention_chunk, &job, (int)chunks, threads);
    /* merge: parts of one (sequence, kv head) are consecutive chunks */
    c = 0;
    for (int s = 0; s < seqs; s++) {
        const int64_t len = offsets[s + 1] - offsets[s];
        const int64_t parts = (len + PART_SLOTS - 1) / PART_SLOTS;
        for (int kh = 0; kh < kv_heads; kh++, c += parts)
            for (int g = 0; g < group; g++) {
                float *oh = out + ((size_t)s * heads + kh * group + g) * hd;
                float mx = -INFINITY, total = 0.0f;
                for (int64_t i = 0; i < parts; i++) {
                    const float m = partial[((size_t)(c + i) * group + g) * (hd + 2)];
                    mx = m > mx ? m : mx;
                }
                for (int d = 0; d < hd; d++) oh[d] = 0.0f;
                for (int64_t i = 0; i < parts; i++) {
                    const float *res = partial + ((size_t)(c + i) * group + g) * (hd + 2);
                    const float w = expf(res[0] - mx);
                    total += w * res[1];
                    for (int d = 0; d < hd; d++) oh[d] += w * res[2 + d];
                }
                const float inv = total > 0.0f ? 1.0f / total : 0.0f;
                for (int d = 0; d < hd; d++) oh[d] *= inv;
            }
    }
    free(part_seq);
    free(part_range);
    free(partial);
    return 0;
}

/* q (seqs, heads, hd) contiguous; caches float32, or float16 when kv_f16; the rest as `attention` */
int ts_decode_attention(const float *q, const void *k_cache, const void *v_cache, int kv_f16, int64_t num_slots,
                        const int64_t *slot_ids, const int64_t *offsets, int seqs, int heads, int kv_heads, int hd,
                        float scale, float *out, int threads) {
    return attention(q, (int64_t)heads * hd, k_cache, v_cache, kv_f16, num_slots, slot_ids, offsets, seqs, heads,
                     kv_heads, hd, scale, out, threads);
}

/* ---- a whole decode step of a Llama-style decoder in one call ----
 *
 * Between the ~10 kernels of a layer, Python and torch cost more than the kernels themselves
 * did on a small model (7-9 ms of a ~18 ms SmolLM2 token: argument marshalling, output
 * tensors, views, the cache write). Here the layers run back to back on buffers allocated once
 * per step: per layer add + RMSNorm, the q/k/v matmul, rotary on q and k, the cache write,
 * attention, o_proj, add + RMSNorm, gate/up, SiLU-mul, down; then the final add + RMSNorm.
 * The matmuls and the attention are split over the pool; the rest is a few microseconds at a
 * few rows and runs on the caller. The layout is what `native_decode.py` describes with
 * ctypes structures of the same fields. */

typedef struct {
    const void *codes;         /* q4: (groups of 8 columns, blocks, 128) uint8; q8: (groups, blocks, 256) */
    const uint16_t *d16, *m16; /* q4: fp16 scales / offsets (groups, blocks, 8) */
    const float *scales;       /* q8: one per output column (padded to 8) */
    const float *bias;         /* (n,) or NULL */
    int bits, n, k;
} ts_linear;

typedef struct {
    const float *input_norm, *post_norm;
    ts_linear qkv, o, gate_up, down;
} ts_layer;

typedef struct {
    const ts_layer *layers;
    const float *final_norm;
    void *k_cache, *v_cache; /* (layers, kv_heads, num_slots, hd) float32, or float16 when kv_f16 */
    int64_t num_slots;
    int n_layers, hidden, heads, kv_heads, hd, inter, kv_f16;
    float eps, scale;
} ts_model;

static int linear_ok(const ts_linear *w, int k, int n) {
    if (w->k != k || w->n != n || !w->codes) return 0;
    if (w->bits == 4) return k % (2 * QK) == 0 && w->d16 && w->m16;
    return w->bits == 8 && k % QK == 0 && w->scales;
}

/* y (rows, n) = x (rows, k) through w, x quantized into qx (room for rows x k) */
static void linear(const ts_linear *w, const float *x, int rows, quantized *qx, float *y, int threads) {
    quantize_rows(x, rows, w->k, qx->q, qx->scale, qx->sum, qx->isum);
    matmul_job job = {qx, w->codes, w->d16, w->m16, w->scales, w->bias, y, rows, w->k, w->n};
    parallel_chunks(w->bits == 4 ? q4_chunk : q8_chunk, &job, (w->n + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK, threads);
}

/* hd floats to a cache row at element `at`: float32, or float16 rounded to nearest even (as
 * torch converts) */
static void store_kv(void *cache, size_t at, const float *x, int hd, int f16) {
    if (!f16) {
        for (int i = 0; i < hd; i++) ((float *)cache)[at + i] = x[i];
        return;
    }
    uint16_t *c = (uint16_t *)cache + at;
    int i = 0;
    for (; i + 8 <= hd; i += 8)
        _mm_storeu_si128((__m128i *)(c + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < hd; i++) c[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
}

/* "rotate half" in place on `heads` heads of hd floats at x, by cos / sin (hd,) */
static void rotate_in_place(float *x, int heads, int hd, const float *c, const float *s) {
    float tmp[MAX_HEAD_DIM];
    for (int h = 0; h < heads; h++) {
        float *xh = x + (size_t)h * hd;
        for (int i = 0; i < hd; i++) tmp[i] = xh[i];
        rotate_head(tmp, xh, hd, c, s);
    }
}

/* x (rows, hidden): the step's token embeddings, one row per decoding sequence; out (rows,
 * hidden): the final norm of the last hidden state, for the lm_head. Row r's position rotates
 * by cos_t / sin_t row r (rows, hd); its k / v go to slot write_slots[r]; it attends over
 * slot_ids[offsets[r] .. offsets[r + 1]) (which include that slot). Returns 0; -1 when the
 * sizes are out of range or memory runs out (nothing written to out). */
int ts_decode_step(const ts_model *m, int rows, const float *x, const float *cos_t, const float *sin_t,
                   const int64_t *write_slots, const int64_t *slot_ids, const int64_t *offsets, float *out,
                   int threads) {
    const int hidden = m->hidden, hd = m->hd, heads = m->heads, kvh = m->kv_heads, inter = m->inter;
    const int qkv_n = (heads + 2 * kvh) * hd, att_n = heads * hd;
    if (rows < 1 || rows > MAX_ROWS || hd > MAX_HEAD_DIM || hd % 2) return -1;
    for (int l = 0; l < m->n_layers; l++) {
        const ts_layer *L = m->layers + l;
        if (!linear_ok(&L->qkv, hidden, qkv_n) || !linear_ok(&L->o, att_n, hidden) ||
            !linear_ok(&L->gate_up, hidden, 2 * inter) || !linear_ok(&L->down, inter, hidden))
            return -1;
    }
    int kmax = hidden > inter ? hidden : inter;
    kmax = kmax > att_n ? kmax : att_n;
    const size_t floats = (size_t)rows * (3 * hidden + qkv_n + att_n + 3 * inter);
    float *buf = (float *)malloc(sizeof(float) * floats);
    quantized qx;
    int rc = -1;
    if (quantized_alloc(rows, kmax, &qx) || !buf) goto done;
    float *resid = buf, *h = resid + (size_t)rows * hidden, *y = h + (size_t)rows * hidden;
    float *qkv = y + (size_t)rows * hidden, *att = qkv + (size_t)rows * qkv_n, *gu = att + (size_t)rows * att_n;
    float *act = gu + (size_t)rows * 2 * inter;
    for (size_t i = 0; i < (size_t)rows * hidden; i++) resid[i] = x[i];
    ts_rms_norm(resid, NULL, NULL, m->layers[0].input_norm, m->eps, rows, hidden, h);
    for (int l = 0; l < m->n_layers; l++) {
        const ts_layer *L = m->layers + l;
        if (l > 0) ts_rms_norm(y, resid, resid, L->input_norm, m->eps, rows, hidden, h);
        linear(&L->qkv, h, rows, &qx, qkv, threads);
        const size_t layer_at = (size_t)l * kvh * m->num_slots * hd, esize = m->kv_f16 ? 2 : 4;
        void *kc = (char *)m->k_cache + layer_at * esize, *vc = (char *)m->v_cache + layer_at * esize;
        for (int r = 0; r < rows; r++) {
            float *qr = qkv + (size_t)r * qkv_n;
            rotate_in_place(qr, heads + kvh, hd, cos_t + (size_t)r * hd, sin_t + (size_t)r * hd);
            for (int kh = 0; kh < kvh; kh++) {
                const size_t at = ((size_t)kh * m->num_slots + (size_t)write_slots[r]) * hd;
                store_kv(kc, at, qr + (size_t)(heads + kh) * hd, hd, m->kv_f16);
                store_kv(vc, at, qr + (size_t)(heads + kvh + kh) * hd, hd, m->kv_f16);
            }
        }
        if (attention(qkv, qkv_n, kc, vc, m->kv_f16, m->num_slots, slot_ids, offsets, rows, heads, kvh, hd, m->scale,
                      att, threads))
            goto done;
        linear(&L->o, att, rows, &qx, y, threads);
        ts_rms_norm(y, resid, resid, L->post_norm, m->eps, rows, hidden, h);
        linear(&L->gate_up, h, rows, &qx, gu, threads);
        ts_silu_mul(gu, rows, inter, act);
        linear(&L->down, act, rows, &qx, y, threads);
    }
    ts_rms_norm(y, resid, resid, m->final_norm, m->eps, rows, hidden, out);
    rc = 0;
done:
    free(buf);
    release(&qx);
    return rc;
}
