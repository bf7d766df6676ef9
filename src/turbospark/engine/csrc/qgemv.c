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
 * - q4: rows of 20-byte blocks per 32 inputs: fp16 d, fp16 m, 16 bytes of codes in [0, 15]
 *   (byte i holds code i in its low nibble, code i + 16 in its high one); w = d * code + m.
 * - q8: int8 codes (out, in) in [-127, 127] and one float scale per output row.
 * Activations and outputs are float32, row-major; `in` is a multiple of 32.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define QK 32
#define MAX_ROWS 8

typedef struct {
    uint16_t d;
    uint16_t m;
    uint8_t qs[QK / 2];
} block_q4;

/* x (rows, k) -> codes (rows, k) int8, per-block scales and per-block sums of x */
static void quantize_rows(const float *x, int rows, int k, int8_t *q, float *scale, float *sum) {
    const int nb = k / QK;
    for (int r = 0; r < rows; r++) {
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
            scale[r * nb + b] = d;
            /* the sum of the quantized block, not of x: the offset term then sees the same
             * rounding as the codes, and the errors of the two terms cancel */
            sum[r * nb + b] = d * (float)s;
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
} quantized;

static int quantize(const float *x, int rows, int k, quantized *out) {
    const int nb = k / QK;
    out->q = (int8_t *)aligned_alloc(64, ((size_t)rows * k + 63) / 64 * 64);
    out->scale = (float *)malloc(sizeof(float) * rows * nb);
    out->sum = (float *)malloc(sizeof(float) * rows * nb);
    if (!out->q || !out->scale || !out->sum) return -1;
    quantize_rows(x, rows, k, out->q, out->scale, out->sum);
    return 0;
}

static void release(quantized *qx) {
    free(qx->q);
    free(qx->scale);
    free(qx->sum);
}

#define INLINE static inline __attribute__((always_inline))

/* one block of a q4 weight row against `ROWS` activation rows, into acc / macc */
INLINE void q4_block(const block_q4 *blk, int b, const quantized *qx, int k, int nb, const int ROWS, __m256 *acc,
                     float *macc) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)blk->qs);
    const __m256i codes = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(*(const int *)blk));
    const float d = _mm_cvtss_f32(dm), m = _mm_cvtss_f32(_mm_movehdup_ps(dm));
    for (int r = 0; r < ROWS; r++) {
        const __m256i xq = _mm256_load_si256((const __m256i *)(qx->q + (size_t)r * k + b * QK));
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(codes, xq), _mm256_set1_epi16(1));
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * qx->scale[r * nb + b]), _mm256_cvtepi32_ps(p), acc[r]);
        macc[r] += m * qx->sum[r * nb + b];
    }
}

/* one output row of a q4 weight against `ROWS` quantized activation rows; blocks two at a time
 * into separate accumulators, so consecutive FMAs do not wait on each other */
INLINE void q4_dot(const block_q4 *wb, int nb, const quantized *qx, int k, const int ROWS, float *out) {
    __m256 acc0[MAX_ROWS], acc1[MAX_ROWS];
    float macc0[MAX_ROWS], macc1[MAX_ROWS];
    for (int r = 0; r < ROWS; r++) {
        acc0[r] = acc1[r] = _mm256_setzero_ps();
        macc0[r] = macc1[r] = 0.0f;
    }
    int b = 0;
    for (; b + 1 < nb; b += 2) {
        q4_block(wb + b, b, qx, k, nb, ROWS, acc0, macc0);
        q4_block(wb + b + 1, b + 1, qx, k, nb, ROWS, acc1, macc1);
    }
    if (b < nb) q4_block(wb + b, b, qx, k, nb, ROWS, acc0, macc0);
    for (int r = 0; r < ROWS; r++) out[r] = hsum(_mm256_add_ps(acc0[r], acc1[r])) + macc0[r] + macc1[r];
}

/* one block of a q8 weight row against `ROWS` activation rows, into acc */
INLINE void q8_block(const int8_t *wblk, int b, const quantized *qx, int k, int nb, const int ROWS, __m256 *acc) {
    const __m256i wq = _mm256_loadu_si256((const __m256i *)wblk);
    const __m256i wabs = _mm256_sign_epi8(wq, wq);
    for (int r = 0; r < ROWS; r++) {
        const __m256i xq = _mm256_load_si256((const __m256i *)(qx->q + (size_t)r * k + b * QK));
        /* |w| * (x with w's sign): unsigned x signed bytes, as vpmaddubsw wants */
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xq, wq)), _mm256_set1_epi16(1));
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(qx->scale[r * nb + b]), _mm256_cvtepi32_ps(p), acc[r]);
    }
}

/* the same for a q8 weight row (scaled by the caller) */
INLINE void q8_dot(const int8_t *wr, int nb, const quantized *qx, int k, const int ROWS, float *out) {
    __m256 acc0[MAX_ROWS], acc1[MAX_ROWS];
    for (int r = 0; r < ROWS; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
    int b = 0;
    for (; b + 1 < nb; b += 2) {
        q8_block(wr + b * QK, b, qx, k, nb, ROWS, acc0);
        q8_block(wr + (b + 1) * QK, b + 1, qx, k, nb, ROWS, acc1);
    }
    if (b < nb) q8_block(wr + b * QK, b, qx, k, nb, ROWS, acc0);
    for (int r = 0; r < ROWS; r++) out[r] = hsum(_mm256_add_ps(acc0[r], acc1[r]));
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

/* y (rows, n) = x (rows, k) @ w.T (+ bias); returns 0, or -1 when rows or memory is out of range */
int ts_q4_matmul(const float *x, int rows, int k, const block_q4 *w, int n, const float *bias, float *y,
                 int threads) {
    if (rows < 1 || rows > MAX_ROWS || k % QK) return -1;
    quantized qx;
    if (quantize(x, rows, k, &qx)) {
        release(&qx);
        return -1;
    }
    const int nb = k / QK;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int o = 0; o < n; o++) {
        float out[MAX_ROWS];
#define Q4(R) q4_dot(w + (size_t)o * nb, nb, &qx, k, R, out)
        FOR_ROWS(rows, Q4)
        const float bo = bias ? bias[o] : 0.0f;
        for (int r = 0; r < rows; r++) y[(size_t)r * n + o] = out[r] + bo;
    }
    release(&qx);
    return 0;
}

/* y (rows, n) = (x (rows, k) @ w.T) * scales (+ bias), w int8 (n, k) */
int ts_q8_matmul(const float *x, int rows, int k, const int8_t *w, const float *scales, int n,
                 const float *bias, float *y, int threads) {
    if (rows < 1 || rows > MAX_ROWS || k % QK) return -1;
    quantized qx;
    if (quantize(x, rows, k, &qx)) {
        release(&qx);
        return -1;
    }
    const int nb = k / QK;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int o = 0; o < n; o++) {
        float out[MAX_ROWS];
#define Q8(R) q8_dot(w + (size_t)o * k, nb, &qx, k, R, out)
        FOR_ROWS(rows, Q8)
        const float bo = bias ? bias[o] : 0.0f;
        for (int r = 0; r < rows; r++) y[(size_t)r * n + o] = out[r] * scales[o] + bo;
    }
    release(&qx);
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

/* y = x * cos + roll(x, half) * sin per head ("rotate half" with the sign folded into sin);
 * x (tokens, heads, hd) with rows of `x_stride` floats per token, cos / sin (tokens, hd) */
void ts_rotary(const float *x, int tokens, int heads, int hd, int x_stride, const float *cos_t, const float *sin_t,
               float *y) {
    const int half = hd / 2;
    for (int t = 0; t < tokens; t++) {
        const float *c = cos_t + (size_t)t * hd, *s = sin_t + (size_t)t * hd;
        for (int h = 0; h < heads; h++) {
            const float *xh = x + (size_t)t * x_stride + (size_t)h * hd;
            float *yh = y + ((size_t)t * heads + h) * hd;
            for (int i = 0; i < half; i++) yh[i] = xh[i] * c[i] + xh[i + half] * s[i];
            for (int i = half; i < hd; i++) yh[i] = xh[i] * c[i] + xh[i - half] * s[i];
        }
    }
}

/* Attention of one new token per sequence over its cached keys and values.
 * q (seqs, heads, hd); k_cache / v_cache (kv_heads, slots, hd); sequence s reads the slots
 * slot_ids[offsets[s] .. offsets[s + 1]); the `heads / kv_heads` query heads of a kv head read
 * each of its keys once. out (seqs, heads, hd). Returns -1 when out of memory. */
int ts_decode_attention(const float *q, const float *k_cache, const float *v_cache, int64_t num_slots,
                        const int64_t *slot_ids, const int64_t *offsets, int seqs, int heads, int kv_heads, int hd,
                        float scale, float *out, int threads) {
    const int group = heads / kv_heads;
    int failed = 0;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int s = 0; s < seqs; s++) {
        for (int kh = 0; kh < kv_heads; kh++) {
            const int64_t len = offsets[s + 1] - offsets[s];
            const int64_t *ids = slot_ids + offsets[s];
            const float *kbase = k_cache + (size_t)kh * num_slots * hd;
            const float *vbase = v_cache + (size_t)kh * num_slots * hd;
            float *p = (float *)malloc(sizeof(float) * (size_t)group * (len > 0 ? len : 1));
            if (!p) {
                failed = 1;
                continue;
            }
            for (int g = 0; g < group; g++) {
                const float *qh = q + ((size_t)s * heads + kh * group + g) * hd;
                float *pg = p + (size_t)g * len;
                float mx = -INFINITY;
                for (int64_t j = 0; j < len; j++) {
                    const float sc = dot_f32(qh, kbase + (size_t)ids[j] * hd, hd) * scale;
                    pg[j] = sc;
                    mx = sc > mx ? sc : mx;
                }
                __m256 tot8 = _mm256_setzero_ps();
                int64_t j = 0;
                for (; j + 8 <= len; j += 8) {
                    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(pg + j), _mm256_set1_ps(mx)));
                    _mm256_storeu_ps(pg + j, e);
                    tot8 = _mm256_add_ps(tot8, e);
                }
                float total = hsum(tot8);
                for (; j < len; j++) {
                    pg[j] = expf(pg[j] - mx);
                    total += pg[j];
                }
                const float inv = total > 0.0f ? 1.0f / total : 0.0f;
                for (int64_t j = 0; j < len; j++) pg[j] *= inv;
            }
            for (int g = 0; g < group; g++) {
                float *oh = out + ((size_t)s * heads + kh * group + g) * hd;
                for (int i = 0; i < hd; i++) oh[i] = 0.0f;
            }
            for (int64_t j = 0; j < len; j++) {
                const float *vj = vbase + (size_t)ids[j] * hd;
                for (int g = 0; g < group; g++) {
                    const float pj = p[(size_t)g * len + j];
                    float *oh = out + ((size_t)s * heads + kh * group + g) * hd;
                    for (int i = 0; i < hd; i++) oh[i] += pj * vj[i];
                }
            }
            free(p);
        }
    }
    return failed ? -1 : 0;
}
