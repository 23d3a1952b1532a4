/* Matrix-vector products on the CPU, for a decode step (and, 3., a batch's: a few matrices' worth).
 *
 * 1. Quantized (qmv):   y[n] = sum_k x[k] * (scale[n, k / g] * q[n, k] + bias[n, k / g])
 *
 * for a weight W [N, K] held as MLX holds it (mx.quantize: q packed along each
 * row as one little-endian bit stream in uint32 words; scales and biases
 * [N, K / g] at float32, float16 or bfloat16).
 *
 * Why: MLX 0.32's CPU quantized_matmul runs a 4096 x 4096 4-bit matvec in
 * ~15 ms here, twice float32 BLAS (7 ms), although it reads 1/7 of the bytes
 * (benchmarks/cpu-kernels/bench_qmm.py). A decode matvec is bound by the bytes it streams from
 * DRAM; this one reads the packed words once and never writes a float weight.
 *
 * Per row and group, acc = sum_k q_k * x_k in float32 lanes, and
 *     y[n] = sum_g scale_g * acc_g + sum_g bias_g * xsum_g
 * where xsum_g (x summed over group g) is computed once per call. The sums run
 * in another order than dequantize-then-dot: not bit-identical to MLX's result,
 * equal to ~1e-6 relative (tests/test_kernels.py holds it to 1e-5).
 *
 * x86-64 with AVX2 + FMA + F16C: 4- and 8-bit rows are unpacked and multiplied
 * in registers (4 bits: x is reordered once per call so that a byte's low and
 * high nibbles meet their own x without a shuffle); with AVX-512 VNNI, multiplied in
 * integers against x written once per call as 8-bit digits (vnni.h). Every other case (2, 3, 5,
 * 6 bits, other CPUs): a portable loop, tested on x86 by switching SIMD off.
 * dequantize: rows of W as float32 (a prompt's chunks, multiplied by BLAS); 4- and 8-bit rows
 * and columns 32 values a step in registers (the same multiply-then-add: the same values).
 *
 * 2. Over chosen rows of a float32 matrix (a neuron cache holds the window's
 * neurons; a token uses the few active ones): gather_mv y[i] = W[sel[i]] . x and
 * gather_axpy y = sum_i h[i] * W[sel[i]], reading those rows only, in place. The same
 * over a matrix held at float16 or bfloat16 (models/half.py, a held dense FFN): each
 * value converted in registers (F16C / a shift) as the row streams, the sums those of the
 * float32 rows, where a float32 arena for BLAS was filled with every weight each token.
 *
 * 3. A batch's decode step (qmm, qmm_rows, qmm_cols: gemm16.h): each quantized row or column
 * dequantized once, into a small tile, and multiplied into every sequence's position.
 *
 * Why one file past 500 lines: every kernel is a kind of one job that the same
 * pool runs (the job struct, the pool and the dispatch are shared); most of the
 * length is each Python entry point checking its buffers before any pointer is
 * followed. Splitting would mean a private header for the pool: worth it when a
 * second architecture's SIMD (NEON) lands.
 *
 * Rows are split over a small persistent pthread pool (the caller's thread
 * takes parts too); the GIL is released while it runs, and no worker
 * touches a Python object. Threads do not survive fork(): a child makes its own, and a fork
 * waits for the product in flight (pthread_atfork).
 */
#define PY_SSIZE_T_CLEAN
#if defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE 1 /* sched_getcpu, pthread_setaffinity_np (pin_workers); 1 as pyconfig.h, which 3.10 defines unguarded */
#endif
#include <Python.h>

#include <pthread.h>
#ifdef __linux__
#include <sched.h>
#endif
#include <stdatomic.h>
#include <time.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "quant.h"
#include "avx512.h"
#include "vnni.h"
#include "vnni_cols.h"

#define MAX_THREADS 64
#define PAR_MIN_WORK (1 << 20) /* weights (values) a job must touch to be shared out */

/* a quantized product's x, prepared once per call (prepare_x_for) */
typedef struct {
    const float *x, *xp, *xsum;  /* x [K]; x reordered for the 4-bit AVX2 loop; [K / g] group sums */
    const float *xe;  /* 4 bits, simd 2: x in row4_avx512's order (avx512.h); else NULL */
    const uint8_t *xd; /* 4 or 8 bits, simd 3: x's digits (vnni.h); else NULL */
    const float *xs;   /* with xd: xsum times 2^-E */
    float xunit;       /* with xd: 2^E, what a row's sum over the digits is multiplied by */
} xprep_t;

/* QMV_MANY: one of its matrices (all [n, k] alike, rows row_bytes apart, scales and biases
 * s_stride / b_stride bytes a row), the x it multiplies and its output [n] */
typedef struct {
    const uint8_t *w, *s, *b;
    const xprep_t *in;
    float *y;
} mat_t;

typedef struct {
    const uint8_t *w;  /* packed rows, row_bytes apart */
    const uint8_t *s, *b;  /* scales, biases: [N, K / g] at scode */
    const float *x;  /* GATHER_MV: x [K] (QMV's x is `in`, below) */
    float *y;    /* QMV, GATHER_MV: [n]; DEQUANTIZE: [n, k]; GATHER_AXPY: [k] */
    int64_t n, k, g, bits, scode, row_bytes;
    int simd, kind;
    /* GATHER_*: float32 rows W [*, k] (w, row_bytes apart), the m rows `sel` of it,
     * and h [m] (GATHER_AXPY: y = sum_i h[i] * W[sel[i]], n = k columns to cut into parts).
     * QMV: sel (if not NULL) picks the rows; scales / biases of row r at s / b + r * stride
     * (a cache row holding its packed values, scales and biases back to back) */
    const int64_t *sel;
    const float *h;
    int64_t m, s_stride, b_stride;
    /* QAXPY_COLS: rows sel[0 .. m-1] of w, each a column of packed values whose value c
     * is ts[trow[i]][c] * q + tb[trow[i]][c] (tables t_stride bytes a row, scode), rows
     * ordered by trow; y[c] = sum_i h[i] * value */
    const int64_t *trow;
    const uint8_t *ts, *tb;
    int64_t t_stride;
    /* GATHER_AXPY, QAXPY_COLS: add to y as it is (a previous part's sum), not to zeros.
     * (Last: py_qmv initializes a job_t positionally, the fields it leaves out zero.) */
    int accumulate;
    xprep_t in; /* QMV: x, prepared */
    const mat_t *mats; /* QMV_MANY: n / per matrices of `per` rows each */
    int64_t per;
    /* QMM_ROWS, QMM_COLS: a pass of `pos` positions (a batch's decode step): x transposed in
     * tiles of 16 positions (xt: tile t's [k][16] at t * k * 16 floats, k the sums' length:
     * QMM_ROWS's k, QMM_COLS's m), the result y[b * ldy + r] (added to y where accumulate) */
    const float *xt;
    int64_t pos, ldy;
    const void *cols_prep; /* QAXPY_COLS at level 3 with VBMI: h prepared (vnni_cols.h); else NULL */
} job_t;

enum { QMV = 0, DEQUANTIZE = 1, GATHER_MV = 2, GATHER_AXPY = 3, QAXPY_COLS = 4, DEQUANT_COLS = 5, QMV_MANY = 6, QMM_ROWS = 7, QMM_COLS = 8,
       GATHER_MM = 9, GATHER_MM_COLS = 10 };

/* ---- one row */

static float dot_portable(const float *a, const float *b, int64_t n) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    float t = 0;
    for (; i < n; i++) t += a[i] * b[i];
    for (int j = 0; j < 8; j++) t += acc[j];
    return t;
}

/* any width: unpack a group to bytes, then eight independent lanes (vectorizable
 * without reassociating a sum) */
static float row_portable(const job_t *j, const uint8_t *w, const float *sc, const float *xf) {
    uint8_t q[128];
    float t = 0;
    for (int64_t k0 = 0; k0 < j->k; k0 += j->g) {
        unpack_bits(w + k0 * j->bits / 8, j->bits, j->g, q);
        float acc[8] = {0};
        for (int64_t i = 0; i < j->g; i += 8)
            for (int l = 0; l < 8; l++) acc[l] += (float)q[i + l] * xf[k0 + i + l];
        float a = 0;
        for (int l = 0; l < 8; l++) a += acc[l];
        t += sc[k0 / j->g] * a;
    }
    return t;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define AVX2_PATH 1
#define AVX2 __attribute__((target("avx2,fma,f16c")))

AVX2 static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* four independent sums: a float32 row streams at the memory's speed, not the FMA's latency */
AVX2 static float dot4_avx2(const float *a, const float *b, int64_t n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), a3);
    }
    float t = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; i < n; i++) t += a[i] * b[i];
    return t;
}

/* a 16-bit row (float16 or bfloat16 bits) . x, converted in registers: 32 values a step in
 * four independent sums, as dot4_avx2 (the row streams once, never written as float32) */
AVX2 static inline __m256 load16_avx2(const uint16_t *w, int bf16) {
    const __m128i h = _mm_loadu_si128((const __m128i *)w);
    return bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
}

/* a row's biases where they lie (p at code: float32, float16 or bfloat16) . x, 8 at a time into
 * one sum, then the tail: the values values_f32 gives, so the same bits as converting them first */
AVX2 static float dot_scales_avx2(const uint8_t *p, int64_t code, const float *x, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = code == F32 ? _mm256_loadu_ps((const float *)p + i) : load16_avx2((const uint16_t *)p + i, code == BF16);
        acc = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + i), acc);
    }
    float t = hsum(acc);
    for (; i < n; i++) t += load_scale(p + (code == F32 ? 4 : 2) * i, code) * x[i];
    return t;
}

AVX2 static float dot16_avx2(const uint16_t *w, const float *x, int64_t n, int64_t code) {
    const int bf16 = code == BF16;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        a0 = _mm256_fmadd_ps(load16_avx2(w + i, bf16), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(load16_avx2(w + i + 8, bf16), _mm256_loadu_ps(x + i + 8), a1);
        a2 = _mm256_fmadd_ps(load16_avx2(w + i + 16, bf16), _mm256_loadu_ps(x + i + 16), a2);
        a3 = _mm256_fmadd_ps(load16_avx2(w + i + 24, bf16), _mm256_loadu_ps(x + i + 24), a3);
    }
    float t = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; i < n; i++) t += load_scale((const uint8_t *)(w + i), code) * x[i];
    return t;
}

/* y[c] += h * W16[c] for c in [c0, c1) 8 at a time (a multiply, then an add: never fused,
 * as the float32 loop) -> the first c left for the caller's loop */
AVX2 static int64_t axpy16_avx2(float h, const uint16_t *w, int64_t code, float *y, int64_t c0, int64_t c1) {
    const int bf16 = code == BF16;
    const __m256 hv = _mm256_set1_ps(h);
    int64_t c = c0;
    for (; c + 8 <= c1; c += 8)
        _mm256_storeu_ps(y + c, _mm256_add_ps(_mm256_loadu_ps(y + c), _mm256_mul_ps(hv, load16_avx2(w + c, bf16))));
    return c;
}

/* n values of a 16-bit row -> float32, 8 at a time -> the first value left for the caller's loop */
AVX2 static int64_t convert16_avx2(const uint16_t *w, int64_t code, int64_t n, float *out) {
    const int bf16 = code == BF16;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, load16_avx2(w + i, bf16));
    return i;
}

/* n values of a 16-bit row -> float32 in blocks of 16, bs floats apart (gather_mm_cols's
 * tile) -> the first value left for the caller (whole blocks only) */
AVX2 static int64_t convert16_blocks_avx2(const uint16_t *w, int64_t code, int64_t n, float *out, int64_t bs) {
    const int bf16 = code == BF16;
    int64_t c = 0;
    for (; c + 16 <= n; c += 16, out += bs) {
        _mm256_storeu_ps(out, load16_avx2(w + c, bf16));
        _mm256_storeu_ps(out + 8, load16_avx2(w + c + 8, bf16));
    }
    return c;
}

/* 4 bits, 32 values (16 bytes) a step: byte i holds values 2i (low nibble) and 2i+1
 * (high); xp holds, per 16 values, the 8 even-indexed x then the 8 odd-indexed */
AVX2 static float row4_avx2(const job_t *j, const uint8_t *w, const float *sc, const float *xp) {
    const __m256i m15 = _mm256_set1_epi32(15);
    __m256 tot = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < j->k; k0 += j->g) {
        const uint8_t *p = w + k0 / 2;
        const float *x = xp + k0;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t i = 0; i < j->g; i += 32, p += 16, x += 32) {
            const __m128i b = _mm_loadu_si128((const __m128i *)p);
            const __m256i v0 = _mm256_cvtepu8_epi32(b), v1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
            a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v0, m15)), _mm256_loadu_ps(x), a0);
            a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4)), _mm256_loadu_ps(x + 8), a1);
            a2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v1, m15)), _mm256_loadu_ps(x + 16), a2);
            a3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4)), _mm256_loadu_ps(x + 24), a3);
        }
        const __m256 a = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
        tot = _mm256_fmadd_ps(_mm256_set1_ps(sc[k0 / j->g]), a, tot);
    }
    return hsum(tot);
}

/* 8 bits, 32 values a step, x in its own order */
AVX2 static float row8_avx2(const job_t *j, const uint8_t *w, const float *sc, const float *xf) {
    __m256 tot = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < j->k; k0 += j->g) {
        const uint8_t *p = w + k0;
        const float *x = xf + k0;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t i = 0; i < j->g; i += 32, p += 32, x += 32) {
            const __m128i b0 = _mm_loadu_si128((const __m128i *)p), b1 = _mm_loadu_si128((const __m128i *)(p + 16));
#define Q8(b) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b))
            a0 = _mm256_fmadd_ps(Q8(b0), _mm256_loadu_ps(x), a0);
            a1 = _mm256_fmadd_ps(Q8(_mm_srli_si128(b0, 8)), _mm256_loadu_ps(x + 8), a1);
            a2 = _mm256_fmadd_ps(Q8(b1), _mm256_loadu_ps(x + 16), a2);
            a3 = _mm256_fmadd_ps(Q8(_mm_srli_si128(b1, 8)), _mm256_loadu_ps(x + 24), a3);
#undef Q8
        }
        const __m256 a = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
        tot = _mm256_fmadd_ps(_mm256_set1_ps(sc[k0 / j->g]), a, tot);
    }
    return hsum(tot);
}
/* 32 4-bit values (16 bytes: byte i holds value 2i low, 2i + 1 high) -> 4 x 8 floats in order */
AVX2 static inline void unpack4_avx2(const uint8_t *p, __m256 v[4]) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p), m = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
    const __m128i a = _mm_unpacklo_epi8(lo, hi), c = _mm_unpackhi_epi8(lo, hi); /* values 0-15, 16-31 */
    v[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(a));
    v[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(a, 8)));
    v[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c));
    v[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(c, 8)));
}

/* 32 8-bit values -> 4 x 8 floats */
AVX2 static inline void unpack8_avx2(const uint8_t *p, __m256 v[4]) {
    const __m128i b0 = _mm_loadu_si128((const __m128i *)p), b1 = _mm_loadu_si128((const __m128i *)(p + 16));
    v[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b0));
    v[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b0, 8)));
    v[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b1));
    v[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b1, 8)));
}

/* values c .. c + 31 (c a multiple of 32) of a 4- or 8-bit row or column p -> 4 x 8 floats */
AVX2 static inline void unpack32_avx2(const uint8_t *p, int64_t bits, int64_t c, __m256 v[4]) {
    if (bits == 4)
        unpack4_avx2(p + c / 2, v);
    else
        unpack8_avx2(p + c, v);
}

/* 8 scales or biases at code -> floats */
AVX2 static inline __m256 load8_scales(const uint8_t *p, int64_t code) {
    if (code == F32) return _mm256_loadu_ps((const float *)p);
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (code == F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); /* bfloat16 */
}

/* dequantize_row's values, 32 at a time: scale * q, then + bias (a multiply, then an add: the
 * same float32 operations, so the same values to the bit) */
AVX2 static void dequantize_row_avx2(const job_t *j, const uint8_t *w, const float *sc, const float *bi, float *out) {
    __m256 v[4];
    for (int64_t k0 = 0; k0 < j->k; k0 += j->g) {
        const __m256 s = _mm256_set1_ps(sc[k0 / j->g]), b = _mm256_set1_ps(bi[k0 / j->g]);
        for (int64_t i = 0; i < j->g; i += 32) {
            unpack32_avx2(w, j->bits, k0 + i, v);
            for (int l = 0; l < 4; l++)
                _mm256_storeu_ps(out + k0 + i + 8 * l, _mm256_add_ps(_mm256_mul_ps(s, v[l]), b));
        }
    }
}

/* nr 4- or 8-bit columns (p[i], their table rows sr[i] / br[i] at code), values [0, n) (n a
 * multiple of 32): ts[c] * q + tb[c], 32 at a time; value c of column i at
 * out[(c / 16) * bs + i * 16 + c % 16] (one column, bs = 16: in order; qmm_cols's tile: blocks
 * of 16 bs apart). The columns are the inner loop, so the stores run along a block (a column
 * at a time would store each 16 values bs floats apart); their lines are read 4 steps each */
AVX2 static void dequant_cols_avx2(const uint8_t *const *p, const uint8_t *const *sr, const uint8_t *const *br,
                                   int64_t nr, int64_t bits, int64_t n, int64_t code, float *out, int64_t bs) {
    const int64_t ssz = code == F32 ? 4 : 2;
    __m256 v[4], s[4], b[4];
    for (int l = 0; l < 4; l++) s[l] = b[l] = _mm256_setzero_ps();
    for (int64_t c = 0; c < n; c += 32) {
        const uint8_t *held_s = NULL, *held_b = NULL; /* (a table row's scales loaded once: dequant_cols4_tile) */
        for (int64_t i = 0; i < nr; i++) {
            if (sr[i] != held_s || br[i] != held_b) {
                held_s = sr[i], held_b = br[i];
                for (int l = 0; l < 4; l++) {
                    s[l] = load8_scales(held_s + (c + 8 * l) * ssz, code);
                    b[l] = load8_scales(held_b + (c + 8 * l) * ssz, code);
                }
            }
            unpack32_avx2(p[i], bits, c, v);
            for (int l = 0; l < 4; l++) {
                const int64_t at = c + 8 * l;
                _mm256_storeu_ps(out + at / 16 * bs + i * 16 + at % 16, _mm256_add_ps(_mm256_mul_ps(s[l], v[l]), b[l]));
            }
        }
    }
}

/* qaxpy_cols's row step over a few rows at once (at most 4), 32 values at a time: acc[c] += h[0] *
 * q_0[c], then += h[1] * q_1[c], ... (each row's multiply, then its add, in the rows' order: the
 * portable loop's operations, so its sums to the bit; setup.py's -ffp-contract=off keeps them
 * from fusing), with acc loaded and stored once for them all instead of once a row (OPT-6.7B's
 * 4-bit down columns here: 5.6-6.1 GB/s a row at a time, 6.4-7.3 with acc loaded once for four) */
AVX2 static void axpy_cols_avx2(const uint8_t *const *p, const float *h, int m, int64_t bits, int64_t n,
                                float *acc) {
    __m256 hv[4], v[4];
    for (int r = 0; r < m; r++) hv[r] = _mm256_set1_ps(h[r]);
    for (int64_t c = 0; c < n; c += 32) {
        __m256 a[4];
        for (int l = 0; l < 4; l++) a[l] = _mm256_loadu_ps(acc + c + 8 * l);
        for (int r = 0; r < m; r++) {
            unpack32_avx2(p[r], bits, c, v);
            for (int l = 0; l < 4; l++) a[l] = _mm256_add_ps(a[l], _mm256_mul_ps(hv[r], v[l]));
        }
        for (int l = 0; l < 4; l++) _mm256_storeu_ps(acc + c + 8 * l, a[l]);
    }
}

/* qaxpy_cols's end of a run: y[c] += (ts[c] * acc[c] + tb[c] * hs), as the portable loop */
AVX2 static void scale_run_avx2(const uint8_t *sr, const uint8_t *br, int64_t code, const float *acc, float hs,
                                int64_t n, float *y) {
    const int64_t ssz = code == F32 ? 4 : 2;
    const __m256 hv = _mm256_set1_ps(hs);
    for (int64_t c = 0; c < n; c += 8) {
        const __m256 a = _mm256_mul_ps(load8_scales(sr + c * ssz, code), _mm256_loadu_ps(acc + c));
        const __m256 b = _mm256_mul_ps(load8_scales(br + c * ssz, code), hv);
        _mm256_storeu_ps(y + c, _mm256_add_ps(_mm256_loadu_ps(y + c), _mm256_add_ps(a, b)));
    }
}
#endif

#include "gemm16.h" /* (after the AVX2 helpers: its 256-bit tiles use them) */

/* the widest loops this CPU runs: 3 AVX-512 VNNI (4- and 8-bit qmv; level 2 for the rest), 2 AVX-512 BF16
 * (4-bit qmv; AVX2 for the rest), 1 AVX2, 0 portable */
static int cpu_simd(void) {
#ifdef AVX2_PATH
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))) return 0;
#ifdef VNNI_PATH
    if (cpu_vnni()) return 3;
#endif
#ifdef BF16_PATH
    if (cpu_bf16()) return 2;
#endif
    return 1;
#else
    return 0;
#endif
}

/* n float32 or 16-bit values (code: a row, or a row's scales / biases) -> float32, exactly */
static void values_f32(const uint8_t *w, int64_t code, int64_t n, int simd, float *out) {
    if (code == F32) {
        memcpy(out, w, sizeof(float) * (size_t)n);
        return;
    }
    int64_t i = 0;
#ifdef AVX2_PATH
    if (simd >= 1) i = convert16_avx2((const uint16_t *)w, code, n, out);
#endif
    (void)simd;
    for (; i < n; i++) out[i] = load_scale(w + 2 * i, code);
}

static int use_simd;
#ifdef VNNI_COLS_PATH
static int use_vbmi; /* level 3's column sums in integers (vnni_cols.h) */
#endif

/* one row's values, scale * q + bias as MLX's dequantize computes them (a float32
 * multiply, then an add: never contracted, see setup.py) */
static void dequantize_row(const job_t *j, const uint8_t *w, const float *sc, const float *bi, float *out) {
    uint8_t buf[128];
    for (int64_t k0 = 0; k0 < j->k; k0 += j->g) {
        const uint8_t *q = buf;
        if (j->bits == 8)
            q = w + k0;
        else
            unpack_bits(w + k0 * j->bits / 8, j->bits, j->g, buf);
        const float s = sc[k0 / j->g], b = bi[k0 / j->g];
        for (int64_t i = 0; i < j->g; i++) {
            const float t = s * (float)q[i];
            out[k0 + i] = t + b;
        }
    }
}

/* a 16-bit row . x, as dot_portable over the row converted to float32 (the same sums) */
static float dot16_portable(const uint16_t *w, const float *x, int64_t n, int64_t code) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) acc[l] += load_scale((const uint8_t *)(w + i + l), code) * x[i + l];
    float t = 0;
    for (; i < n; i++) t += load_scale((const uint8_t *)(w + i), code) * x[i];
    for (int l = 0; l < 8; l++) t += acc[l];
    return t;
}

/* GATHER_MV, rows [r0, r1) of sel: y[i] = W[sel[i]] . x (W float32, or 16-bit: scode) */
static void gather_mv(const job_t *j, int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; i++) {
        const uint8_t *w = j->w + j->sel[i] * j->row_bytes;
#ifdef AVX2_PATH
        if (j->simd) {
            j->y[i] = j->scode == F32 ? dot4_avx2((const float *)w, j->x, j->k)
                                      : dot16_avx2((const uint16_t *)w, j->x, j->k, j->scode);
            continue;
        }
#endif
        j->y[i] = j->scode == F32 ? dot_portable((const float *)w, j->x, j->k)
                                  : dot16_portable((const uint16_t *)w, j->x, j->k, j->scode);
    }
}

/* GATHER_AXPY, columns [c0, c1): y[c] = sum_i h[i] * W[sel[i], c], rows in order */
static void gather_axpy(const job_t *j, int64_t c0, int64_t c1) {
    float *y = j->y;
    if (!j->accumulate)
        for (int64_t c = c0; c < c1; c++) y[c] = 0;
    for (int64_t i = 0; i < j->m; i++) {
        const uint8_t *row = j->w + j->sel[i] * j->row_bytes;
        const float hi = j->h[i];
        if (j->scode != F32) { /* 16-bit rows: each value converted, then the same multiply and add */
            int64_t c = c0;
#ifdef AVX2_PATH
            if (j->simd) c = axpy16_avx2(hi, (const uint16_t *)row, j->scode, y, c0, c1);
#endif
            for (; c < c1; c++) {
                const float t = hi * load_scale(row + 2 * c, j->scode);
                y[c] += t;
            }
            continue;
        }
        const float *w = (const float *)row;
        for (int64_t c = c0; c < c1; c++) {
            const float t = hi * w[c];
            y[c] += t;
        }
    }
}

/* values b .. b + len - 1 (len <= 128, b a multiple of 32) of a packed column p, as bytes:
 * at 8 bits the column itself, else unpacked into q */
static inline const uint8_t *block_values(const uint8_t *p, int64_t bits, int64_t b, int64_t len, uint8_t *q) {
    if (bits == 8) return p + b;
    unpack_bits(p + b * bits / 8, bits, len, q);
    return q;
}

/* QAXPY_COLS, values [c0, c1) of every column: per run of rows sharing a table row t,
 * acc = sum_i h_i * q_i and hs = sum_i h_i, then y += ts[t] * acc + tb[t] * hs.
 * acc: scratch of c1 - c0 floats. */
static void qaxpy_cols(const job_t *j, int64_t c0, int64_t c1, float *acc) {
    const int64_t n = c1 - c0, bits = j->bits;
    float *y = j->y;
    uint8_t q[128];
    if (!j->accumulate)
        for (int64_t c = c0; c < c1; c++) y[c] = 0;
#ifdef VNNI_COLS_PATH
    if (j->cols_prep) {
        qaxpy_cols_vnni(j->cols_prep, j->w, j->row_bytes, bits, j->ts, j->tb, j->t_stride, j->scode, c0, c1, y);
        return;
    }
#endif
    int64_t i = 0;
    while (i < j->m) {
        const int64_t t = j->trow[i];
        float hs = 0;
        for (int64_t c = 0; c < n; c++) acc[c] = 0;
#ifdef AVX2_PATH
        const int simd = j->simd && (bits == 4 || bits == 8) && n % 32 == 0;
        if (simd) { /* the run's rows 4 at a time (hs summed in the same order) */
            while (i < j->m && j->trow[i] == t) {
                const uint8_t *ps[4];
                float hb[4];
                int m = 0;
                for (; m < 4 && i < j->m && j->trow[i] == t; m++, i++) {
                    ps[m] = j->w + j->sel[i] * j->row_bytes + c0 * bits / 8;
                    hb[m] = j->h[i];
                    hs += hb[m];
                }
                for (int64_t k = i; k < i + 4 && k < j->m; k++) { /* the next rows' values, fetched meanwhile */
                    const uint8_t *next = j->w + j->sel[k] * j->row_bytes + c0 * bits / 8;
                    for (int64_t o = 0; o < n * bits / 8; o += 64) _mm_prefetch((const char *)next + o, _MM_HINT_T0);
                }
#ifdef BF16_PATH
                if (j->simd >= 2)
                    axpy_cols_avx512(ps, hb, m, bits, n, acc);
                else
#endif
                    axpy_cols_avx2(ps, hb, m, bits, n, acc);
            }
        }
#endif
        for (; i < j->m && j->trow[i] == t; i++) {
            const uint8_t *p = j->w + j->sel[i] * j->row_bytes + c0 * bits / 8;
            const float h = j->h[i];
            hs += h;
            for (int64_t b = 0; b < n; b += 128) {
                const int64_t len = n - b < 128 ? n - b : 128;
                const uint8_t *qb = block_values(p, bits, b, len, q);
                for (int64_t v = 0; v < len; v++) {
                    const float u = h * (float)qb[v];
                    acc[b + v] += u;
                }
            }
        }
        const uint8_t *sr = j->ts + t * j->t_stride, *br = j->tb + t * j->t_stride;
        const int64_t ssz = j->scode == F32 ? 4 : 2;
#ifdef AVX2_PATH
        if (simd) {
            scale_run_avx2(sr + c0 * ssz, br + c0 * ssz, j->scode, acc, hs, n, y + c0);
            continue;
        }
#endif
        for (int64_t c = 0; c < n; c++) {
            const float a = load_scale(sr + (c0 + c) * ssz, j->scode) * acc[c];
            const float bb = load_scale(br + (c0 + c) * ssz, j->scode) * hs;
            y[c0 + c] += a + bb;
        }
    }
}

/* one row (packed values w, scales sp, biases bp) . x; sc, bi: scratch for its K / g scales and biases (the
 * SIMD paths read the biases, and the AVX-512 VNNI path the scales too, where they lie) */
static float qmv_row(const job_t *j, const uint8_t *w, const uint8_t *sp, const uint8_t *bp, const xprep_t *in,
                     float *sc, float *bi) {
    const int64_t ng = j->k / j->g;
#ifdef VNNI_PATH
    if (in->xd) return row_vnni(w, sp, bp, j->scode, in->xd, in->xs, in->xunit, j->k, j->g, j->bits, sc);
#endif
#ifdef AVX2_PATH
    if (j->simd && (j->bits == 4 || j->bits == 8)) {
        const float b = dot_scales_avx2(bp, j->scode, in->xsum, ng);
        values_f32(sp, j->scode, ng, j->simd, sc);
#ifdef BF16_PATH
        if (in->xe) return row4_avx512(w, sc, in->xe, j->k, j->g) + b;
#endif
        const float t = j->bits == 4 ? row4_avx2(j, w, sc, in->xp) : row8_avx2(j, w, sc, in->x);
        return t + b;
    }
#endif
    values_f32(sp, j->scode, ng, 0, sc);
    values_f32(bp, j->scode, ng, 0, bi);
    return row_portable(j, w, sc, in->x) + dot_portable(bi, in->xsum, ng);
}

/* one row rr of a quantized matrix (DEQUANTIZE's layout: values, scales and biases of row rr at
 * w / s / b + rr * row_bytes / s_stride / b_stride) -> out [k] float32; sc, bi: K / g scratch */
static void dequantize_one(const job_t *j, int64_t rr, float *sc, float *bi, float *out) {
    const int64_t ng = j->k / j->g;
    const uint8_t *w = j->w + rr * j->row_bytes;
    values_f32(j->s + rr * j->s_stride, j->scode, ng, j->simd, sc);
    values_f32(j->b + rr * j->b_stride, j->scode, ng, j->simd, bi);
#ifdef BF16_PATH
    if (j->simd >= 2 && j->bits == 4) {
        dequantize_row4_avx512(w, sc, bi, j->k, j->g, out);
        return;
    }
#endif
#ifdef AVX2_PATH
    if (j->simd && (j->bits == 4 || j->bits == 8)) {
        dequantize_row_avx2(j, w, sc, bi, out);
        return;
    }
#endif
    dequantize_row(j, w, sc, bi, out);
}

/* values [c0, c1) of packed column i of a QMM_COLS / DEQUANT_COLS job (c0, c1 - c0 multiples of 32)
 * -> out, value c0 + c at out[(c / 16) * bs + c % 16] (dequant_cols_avx2's blocks) */
static void dequantize_col_part(const job_t *j, int64_t i, int64_t c0, int64_t c1, float *out, int64_t bs) {
    const int64_t ssz = j->scode == F32 ? 4 : 2, bits = j->bits, n = c1 - c0;
    const uint8_t *p = j->w + j->sel[i] * j->row_bytes + c0 * bits / 8;
    const uint8_t *sr = j->ts + j->trow[i] * j->t_stride + c0 * ssz, *br = j->tb + j->trow[i] * j->t_stride + c0 * ssz;
#ifdef BF16_PATH
    if (j->simd >= 2 && bits == 4 && n % 32 == 0) {
        dequant_cols4_tile(&p, &sr, &br, 1, n, j->scode, out, bs);
        return;
    }
#endif
#ifdef AVX2_PATH
    if (j->simd && (bits == 4 || bits == 8) && n % 32 == 0) {
        dequant_cols_avx2(&p, &sr, &br, 1, bits, n, j->scode, out, bs);
        return;
    }
#endif
    uint8_t q[128];
    for (int64_t b = 0; b < n; b += 128) {
        const int64_t len = n - b < 128 ? n - b : 128;
        const uint8_t *qb = block_values(p, bits, b, len, q);
        for (int64_t v = 0; v < len; v++) {
            const float t = load_scale(sr + (b + v) * ssz, j->scode) * (float)qb[v];
            out[(b + v) / 16 * bs + (b + v) % 16] = t + load_scale(br + (b + v) * ssz, j->scode);
        }
    }
}

/* DEQUANT_COLS, rows [r0, r1) of sel: y[i, c] = ts[trow[i]][c] * q + tb[trow[i]][c], k values a row */
static void dequant_cols(const job_t *j, int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; i++) dequantize_col_part(j, i, 0, j->k, j->y + i * j->k, 16);
}

/* a pass's results for the nr (<= MM16_ROWS) rows in `tile` (rows k + MM16_PAD floats apart),
 * rows t0 .. t0 + nr - 1 of the job's output: y[b, t0 + i] = tile row i . x[b] for every
 * position b. AVX-512 or AVX2: the tile for every tile, a last one of fewer rows zero-padded (a
 * row's sum is then the same whichever part holds it); else the portable loop. */
static void tile_rows_product(const job_t *j, int64_t t0, int64_t nr, float *tile) {
    const int64_t k = j->k, kp = k + MM16_PAD;
    for (int64_t p0 = 0; p0 < j->pos; p0 += 16) {
        const int64_t m = j->pos - p0 < 16 ? j->pos - p0 : 16;
        const float *xt = j->xt + p0 * k;
        float *y = j->y + p0 * j->ldy + t0;
#ifdef AVX2_PATH
        if (j->simd >= 1) {
            float out[MM16_ROWS * 16];
            if (nr < MM16_ROWS) memset(tile + nr * kp, 0, sizeof(float) * (size_t)((MM16_ROWS - nr) * kp));
#ifdef BF16_PATH
            if (j->simd >= 2)
                mm16_tile(tile, kp, xt, k, out);
            else
#endif
                mm16_tile_avx2(tile, kp, xt, k, out);
            for (int64_t b = 0; b < m; b++)
                for (int64_t i = 0; i < nr; i++) y[b * j->ldy + i] = out[i * 16 + b];
            continue;
        }
#endif
        for (int64_t i = 0; i < nr; i++) mm16_row_portable(tile + i * kp, 1, xt, k, m, y + i, j->ldy, 0, MM16_RUN);
    }
}

/* QMM_ROWS, rows [r0, r1): MM16_ROWS rows at a time dequantized into `tile` (MM16_ROWS rows of
 * k + MM16_PAD floats), then multiplied into every position: y[b, r] = row r . x[b]. sc, bi:
 * K / g scratch. */
static void qmm_rows(const job_t *j, int64_t r0, int64_t r1, float *sc, float *bi, float *tile) {
    const int64_t kp = j->k + MM16_PAD; /* (the tile's rows a line further apart than k) */
    for (int64_t t0 = r0; t0 < r1; t0 += MM16_ROWS) {
        const int64_t nr = r1 - t0 < MM16_ROWS ? r1 - t0 : MM16_ROWS;
        for (int64_t i = 0; i < nr; i++) dequantize_one(j, j->sel ? j->sel[t0 + i] : t0 + i, sc, bi, tile + i * kp);
        tile_rows_product(j, t0, nr, tile);
    }
}

/* GATHER_MM, rows [r0, r1) of sel: y[b, i] = W[sel[i]] . x[b] (W float32 or 16-bit: scode),
 * MM16_ROWS rows at a time converted into `tile`, then multiplied into every position as
 * QMM_ROWS's dequantized rows */
static void gather_mm(const job_t *j, int64_t r0, int64_t r1, float *tile) {
    const int64_t kp = j->k + MM16_PAD;
    for (int64_t t0 = r0; t0 < r1; t0 += MM16_ROWS) {
        const int64_t nr = r1 - t0 < MM16_ROWS ? r1 - t0 : MM16_ROWS;
        for (int64_t i = 0; i < nr; i++)
            values_f32(j->w + j->sel[t0 + i] * j->row_bytes, j->scode, j->k, j->simd, tile + i * kp);
        tile_rows_product(j, t0, nr, tile);
    }
}

/* a pass's sums over the nr (<= MM16_KBLOCK) columns i0 .. i0 + nr - 1 in `tile` (their values
 * c0 .. c0 + w - 1 in blocks of 16: value c of column i at tile[(c / 16) * bs + i * 16 + c % 16]),
 * for every position: y[b, c0 + c] (+)= sum_i x[b, i0 + i] * value (added to y where `add`) */
static void tile_cols_product(const job_t *j, int64_t i0, int64_t nr, int64_t c0, int64_t w, int add,
                              const float *tile, int64_t bs) {
    for (int64_t p0 = 0; p0 < j->pos; p0 += 16) {
        const int64_t m = j->pos - p0 < 16 ? j->pos - p0 : 16;
        const float *xt = j->xt + p0 * j->m + i0 * 16;
        float *y = j->y + p0 * j->ldy + c0;
        int64_t c = 0;
#ifdef BF16_PATH
        if (j->simd >= 2) {
            mm16_cols(tile, bs, xt, nr, m, y, j->ldy, add, w);
            continue;
        }
#endif
#ifdef AVX2_PATH
        if (j->simd >= 1) { /* whole registers of 8 outputs; the rest below */
            c = w & ~(int64_t)7;
            mm16_cols_avx2(tile, bs, xt, nr, m, y, j->ldy, add, c);
        }
#endif
        for (; c < w; c++) mm16_row_portable(tile + c / 16 * bs + c % 16, 16, xt, nr, m, y + c, j->ldy, add, 0);
    }
}

/* QMM_COLS, outputs [c0, c1) (multiples of 32 but the last): the m columns' values c0 .. c1-1,
 * MM16_KBLOCK columns at a time, dequantized into `tile` in blocks of 16 values (value c of the
 * block's column i at tile[(c / 16) * MM16_KBLOCK * 16 + i * 16 + c % 16]: a pass over 16
 * outputs reads one contiguous block, not a line from each of MM16_KBLOCK rows), then
 * y[b, c] (+)= sum_i x[b, i] * value */
static void qmm_cols(const job_t *j, int64_t c0, int64_t c1, float *tile) {
    const int64_t w = c1 - c0, bs = MM16_KBLOCK * 16;
    for (int64_t i0 = 0; i0 < j->m; i0 += MM16_KBLOCK) {
        const int64_t nr = j->m - i0 < MM16_KBLOCK ? j->m - i0 : MM16_KBLOCK;
#ifdef AVX2_PATH
        if (j->simd >= 1 && (j->bits == 4 || j->bits == 8) && w % 32 == 0) {
            const int64_t ssz = j->scode == F32 ? 4 : 2;
            const uint8_t *p[MM16_KBLOCK], *sr[MM16_KBLOCK], *br[MM16_KBLOCK];
            for (int64_t i = 0; i < nr; i++) {
                p[i] = j->w + j->sel[i0 + i] * j->row_bytes + c0 * j->bits / 8;
                sr[i] = j->ts + j->trow[i0 + i] * j->t_stride + c0 * ssz;
                br[i] = j->tb + j->trow[i0 + i] * j->t_stride + c0 * ssz;
            }
#ifdef BF16_PATH
            if (j->simd >= 2 && j->bits == 4)
                dequant_cols4_tile(p, sr, br, nr, w, j->scode, tile, bs);
            else
#endif
                dequant_cols_avx2(p, sr, br, nr, j->bits, w, j->scode, tile, bs);
        } else
#endif
            for (int64_t i = 0; i < nr; i++) dequantize_col_part(j, i0 + i, c0, c1, tile + i * 16, bs);
        tile_cols_product(j, i0, nr, c0, w, j->accumulate || i0 > 0, tile, bs);
    }
}

/* GATHER_MM_COLS, outputs [c0, c1) (multiples of 16 but the last): y[b, c] (+)= sum_i x[b, i] *
 * W[sel[i], c] (W float32 or 16-bit: scode), MM16_KBLOCK rows at a time, their values c0 ..
 * c1-1 converted into `tile` as QMM_COLS's dequantized columns, then multiplied alike */
static void gather_mm_cols(const job_t *j, int64_t c0, int64_t c1, float *tile) {
    const int64_t w = c1 - c0, bs = MM16_KBLOCK * 16, vb = j->scode == F32 ? 4 : 2;
    for (int64_t i0 = 0; i0 < j->m; i0 += MM16_KBLOCK) {
        const int64_t nr = j->m - i0 < MM16_KBLOCK ? j->m - i0 : MM16_KBLOCK;
        for (int64_t i = 0; i < nr; i++) {
            const uint8_t *row = j->w + j->sel[i0 + i] * j->row_bytes + c0 * vb;
            int64_t c = 0;
#ifdef AVX2_PATH
            if (j->simd >= 1 && j->scode != F32) c = convert16_blocks_avx2((const uint16_t *)row, j->scode, w, tile + i * 16, bs);
#endif
            for (; c < w; c += 16)
                values_f32(row + c * vb, j->scode, w - c < 16 ? w - c : 16, j->simd, tile + c / 16 * bs + i * 16);
        }
        tile_cols_product(j, i0, nr, c0, w, j->accumulate || i0 > 0, tile, bs);
    }
}

/* rows [r0, r1) of the job; sc, bi: scratch for one row's K / g scales and biases */
/* a quantized row's values, scales and biases fetched into the caches ahead of its product: one
 * row at a time, a core's prefetchers alone streamed 4-bit rows at ~8 GB/s here, with the rows two
 * ahead asked for ~12 (the rows lie apart, a cache's rows where its selection puts them) */
#define ROWS_AHEAD 2
static inline void prefetch_row(const job_t *j, const uint8_t *w, const uint8_t *sp, const uint8_t *bp) {
    const int64_t vb = j->k * j->bits / 8, sb = (j->k / j->g) * (j->scode == F32 ? 4 : 2);
    for (int64_t o = 0; o < vb; o += 64) __builtin_prefetch(w + o);
    for (int64_t o = 0; o < sb; o += 64) __builtin_prefetch(sp + o), __builtin_prefetch(bp + o);
}

static void run_rows(const job_t *j, int64_t r0, int64_t r1, float *sc, float *bi) {
    if (j->kind == DEQUANT_COLS) {
        dequant_cols(j, r0, r1);
        return;
    }
    if (j->kind == GATHER_MV) {
        gather_mv(j, r0, r1);
        return;
    }

    if (j->kind == GATHER_AXPY) {
        gather_axpy(j, r0, r1);
        return;
    }
    if (j->kind == QAXPY_COLS) {
        qaxpy_cols(j, r0, r1, sc);
        return;
    }
    if (j->kind == QMV_MANY) {
        for (int64_t r = r0; r < r1; r++) {
            if (r + ROWS_AHEAD < r1) {
                const mat_t *a = j->mats + (r + ROWS_AHEAD) / j->per;
                const int64_t ra = (r + ROWS_AHEAD) % j->per;
                prefetch_row(j, a->w + ra * j->row_bytes, a->s + ra * j->s_stride, a->b + ra * j->b_stride);
            }
            const mat_t *m = j->mats + r / j->per;
            const int64_t rr = r % j->per;
            m->y[rr] = qmv_row(j, m->w + rr * j->row_bytes, m->s + rr * j->s_stride, m->b + rr * j->b_stride, m->in,
                               sc, bi);
        }
        return;
    }
    for (int64_t r = r0; r < r1; r++) {
        const int64_t rr = j->sel ? j->sel[r] : r;
        const uint8_t *w = j->w + rr * j->row_bytes, *sp = j->s + rr * j->s_stride, *bp = j->b + rr * j->b_stride;
        if (j->kind == DEQUANTIZE) {
            dequantize_one(j, rr, sc, bi, j->y + r * j->k);
            continue;
        }
        if (r + ROWS_AHEAD < r1) {
            const int64_t ra = j->sel ? j->sel[r + ROWS_AHEAD] : r + ROWS_AHEAD;
            prefetch_row(j, j->w + ra * j->row_bytes, j->s + ra * j->s_stride, j->b + ra * j->b_stride);
        }
        j->y[r] = qmv_row(j, w, sp, bp, &j->in, sc, bi);
    }
}

/* ---- the pool: workers 1 .. n-1 wait for a new generation, take parts of its job, report
 *
 * Waking a thread asleep on a condition variable costs 20-60 us on a virtual machine, as
 * long as a 768 x 2048 4-bit matvec on two threads: a decode of a mixture of experts makes
 * ~1,300 such calls a token, ~100 us apart. So a worker spins (pause) for SPIN_NS after its
 * last job before it sleeps, and the caller spins for the parts taken before it waits:
 * calls in quick succession never touch the kernel's scheduler; a pool left idle sleeps.
 *
 * A job is cut into parts that the caller and the workers take from one counter until none is
 * left: a thread that runs slower (a CPU shared with another process, a worker woken late, an
 * efficiency core) takes fewer, and the caller never waits for a worker that has not started.
 * With a fixed share a thread, beside a busy process a job would take as long as the share on
 * the shared CPU, as long as one thread alone or longer. A job over rows is cut into
 * up to PARTS_PER_THREAD parts a thread, each of PART_MIN_WORK multiply-adds or more (a tile
 * kind's parts whole tiles); a job over columns (QAXPY_COLS, QMM_COLS, GATHER_AXPY,
 * GATHER_MM_COLS) into one a thread, since each part walks every row for its columns: more
 * parts cost more than they save. A row's or column's
 * sum does not depend on the part that holds it: the values are the same whoever runs it.
 * The counter holds the generation's low 32 bits and the job's part count above the next
 * part, so that one compare-and-swap checks all three: a worker late for one job takes
 * nothing of the next one's, nor a part past the next one's count (as it could if the count
 * were a field of its own, read apart from the counter). */

#define SPIN_NS 200000 /* 0.2 ms; MLX_FLASH_KERNEL_SPIN_US overrides (0: always sleep) */
#define PARTS_PER_THREAD 8 /* a job over rows; set_parts overrides (the A/B scripts) */
#define MAX_PARTS 0xFFFF /* the counter's 16 bits for a job's parts (MAX_THREADS x set_parts' 64 at most) */
#define PART_MIN_WORK (1 << 18) /* multiply-adds a part makes at the least (a pass: weights x positions) */

static struct {
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    pthread_t th[MAX_THREADS];
    int n;        /* threads in all, the caller's included; 1: no workers */
    int want;     /* threads asked for (set_threads) */
    pid_t pid;    /* the process that started the workers */
    _Atomic uint64_t gen;  /* a new job (or a stop) is a new generation; job, pending and next are set before */
    uint64_t start_gen;
    _Atomic uint64_t next;  /* the generation's low 32 bits << 32 | the job's parts << 16 | the next part to take */
    _Atomic uint64_t pending;  /* the job's parts not finished */
    int sleepers, waiting;  /* under mu: workers asleep on go; the caller asleep on done */
    _Atomic(const job_t *) job;  /* read by a worker only after it has claimed a part of it */
    _Atomic int stop;  /* the workers are to end (a new pool size) */
    int parts_per;  /* parts a thread (set_parts; 0: PARTS_PER_THREAD) */
    int64_t taken[MAX_THREADS];  /* parts each thread ran since the pool started (parts_taken) */
    float *scratch;  /* scratch_per floats for each of scratch_n threads (the most a job asked for) */
    int64_t scratch_per;
    int scratch_n;
    int64_t spin_ns;
    int pin;         /* pin_workers on (Linux; MLX_FLASH_KERNEL_PIN=0, set_pinning(0) or a refused placement: off) */
    int caller_cpu;  /* the caller's CPU the workers were last placed around (-1: none yet) */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER};

/* ---- where the workers run (Linux)
 *
 * A job's parts run on two CPUs only if its threads do. After the caller has slept (a
 * layer's reads, ~50 ms in --mode naive), the scheduler of a virtual machine often wakes the
 * worker on the caller's own CPU (likely: Linux's idle-CPU test counts a virtual CPU its host
 * descheduled as busy) and moves it only some milliseconds later: the two threads then share
 * one CPU (with a fixed share each, slower than one thread alone: naive's attention and FFN-row
 * products 1.3-2.3x dense's, benchmarks/kernel-pinning/kernel_calls.txt). So, when the pool has no more threads than
 * the caller had CPUs when its workers started, each worker is pinned to a CPU of that mask of
 * its own, not the caller's current one: the first placement takes the CPUs after the caller's
 * (two processes' workers spread by their callers' CPUs); when a call finds the caller moved
 * (sched_getcpu, a few ns), only the worker on the caller's new CPU moves, to the CPU the
 * caller left where it is free (one syscall). The caller itself is never pinned. A placement
 * the system refuses (a cpuset shrunk since) frees every worker and turns pinning off
 * (pinning() says so). Elsewhere: nothing. */

#ifdef __linux__
static int pin_request = -1; /* set_pinning's (-1: never called: MLX_FLASH_KERNEL_PIN decides) */
#endif

/* whether a pool starting now pins its workers: set_pinning's word, else MLX_FLASH_KERNEL_PIN
 * (only "0" turns it off); never off Linux */
static int pin_wanted(void) {
#ifdef __linux__
    const char *env = getenv("MLX_FLASH_KERNEL_PIN");
    return pin_request >= 0 ? pin_request : !(env && !strcmp(env, "0"));
#else
    return 0;
#endif
}

#ifdef __linux__
static cpu_set_t pin_allowed; /* the caller's CPUs when the workers started */
static int worker_cpu[MAX_THREADS]; /* the CPU each worker is pinned to (-1: none) */

/* cpu is in the mask, not the caller's (c) and not a worker's */
static int cpu_free(int cpu, int c) {
    if (cpu < 0 || cpu >= CPU_SETSIZE || cpu == c || !CPU_ISSET(cpu, &pin_allowed)) return 0;
    for (int i = 1; i < pool.n; i++)
        if (worker_cpu[i] == cpu) return 0;
    return 1;
}

/* the workers free to run anywhere in that mask again */
static void unpin_workers(void) {
    for (int i = 1; i < pool.n; i++) {
        pthread_setaffinity_np(pool.th[i], sizeof pin_allowed, &pin_allowed);
        worker_cpu[i] = -1;
    }
    pool.caller_cpu = -1;
}

static void pin_workers(void) {
    const int c = sched_getcpu();
    if (!pool.pin || c < 0 || c == pool.caller_cpu || pool.n > CPU_COUNT(&pin_allowed)) return;
    for (int i = 1; i < pool.n; i++) {
        if (worker_cpu[i] >= 0 && worker_cpu[i] != c) continue; /* placed, and not on the caller's CPU */
        worker_cpu[i] = -1;
        int cpu = cpu_free(pool.caller_cpu, c) ? pool.caller_cpu : -1; /* the CPU the caller left */
        for (int s = 1; cpu < 0 && s <= CPU_SETSIZE; s++) /* else the next free one after the caller's */
            if (cpu_free((c + s) % CPU_SETSIZE, c)) cpu = (c + s) % CPU_SETSIZE;
        cpu_set_t one;
        CPU_ZERO(&one);
        if (cpu >= 0) CPU_SET(cpu, &one);
        if (cpu < 0 || pthread_setaffinity_np(pool.th[i], sizeof one, &one)) {
            unpin_workers();
            pool.pin = 0;
            return;
        }
        worker_cpu[i] = cpu;
    }
    pool.caller_cpu = c;
}
#else
static void pin_workers(void) {}
#endif

/* what a part's boundaries are multiples of (but the job's end), by kind: whole 32-value
 * blocks of packed columns (whole bytes at any width), whole 64-byte lines of float columns,
 * whole tiles of rows (a tile kind's rows then each in one part's tiles) */
static int64_t part_unit(int kind) {
    switch (kind) {
    case QAXPY_COLS:
    case QMM_COLS:
        return 32;
    case GATHER_AXPY:
    case GATHER_MM_COLS:
        return 16;
    case QMM_ROWS:
    case GATHER_MM:
        return MM16_ROWS;
    default:
        return 1;
    }
}

/* part c of a job cut into `parts`, on thread t (its scratch) */
static void run_part(const job_t *j, int t, int64_t c, int64_t parts) {
    const int64_t u = part_unit(j->kind), end = j->n * (c + 1) / parts;
    const int64_t r0 = (j->n * c / parts) & ~(u - 1), r1 = end == j->n ? end : end & ~(u - 1);
    float *sc = pool.scratch + t * pool.scratch_per;
    if (j->kind == QMM_ROWS) { /* scratch: scales, biases, then the tile (qmm_scratch) */
        const int64_t ng = j->k / j->g;
        qmm_rows(j, r0, r1, sc, sc + ng, sc + 2 * ng);
        return;
    }
    if (j->kind == QMM_COLS) {
        qmm_cols(j, r0, r1, sc);
        return;
    }
    if (j->kind == GATHER_MM) { /* scratch: the tile */
        gather_mm(j, r0, r1, sc);
        return;
    }
    if (j->kind == GATHER_MM_COLS) {
        gather_mm_cols(j, r0, r1, sc);
        return;
    }
    run_rows(j, r0, r1, sc, sc + pool.scratch_per / 2);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* spin until *v == want (is_equal) or != want (else), for at most pool.spin_ns -> 1 if it
 * happened, 0 if the caller must sleep on a condition */
static int spin_until(_Atomic uint64_t *v, uint64_t want, int is_equal) {
    const int64_t end = pool.spin_ns > 0 ? now_ns() + pool.spin_ns : 0;
    for (;;) {
        for (int i = 0; i < 64; i++) {
            if ((atomic_load_explicit(v, memory_order_acquire) == want) == is_equal) return 1;
            if (!end) return 0;
            cpu_relax();
        }
        if (now_ns() > end) return 0;
    }
}

/* thread t takes parts of generation `tag`'s job and runs them until none is left; the thread
 * that finishes the last part while the caller sleeps wakes it */
static void take_parts(int t, uint32_t tag) {
    for (;;) {
        uint64_t c = atomic_load_explicit(&pool.next, memory_order_acquire);
        const int64_t p = (int64_t)(c & 0xFFFF), parts = (int64_t)((c >> 16) & 0xFFFF);
        if ((uint32_t)(c >> 32) != tag || p >= parts) return; /* a later job's counter, or this one's parts all taken */
        if (!atomic_compare_exchange_weak_explicit(&pool.next, &c, c + 1, memory_order_acq_rel, memory_order_relaxed))
            continue;
        /* part p is this thread's: the job cannot finish, nor the next be published, before this
         * part's fetch_sub below, so pool.job is still this generation's (stored before the
         * release of next that the claim read) */
        run_part(atomic_load_explicit(&pool.job, memory_order_relaxed), t, p, parts);
        pool.taken[t]++; /* (read by parts_taken after the job, which this part's fetch_sub precedes) */
        if (atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_acq_rel) == 1 && t) {
            pthread_mutex_lock(&pool.mu); /* the last part: wake the caller if it sleeps */
            if (pool.waiting) pthread_cond_signal(&pool.done);
            pthread_mutex_unlock(&pool.mu);
        }
    }
}

static void *worker(void *arg) {
    const int i = (int)(intptr_t)arg;
    uint64_t seen = pool.start_gen; /* set before this thread started; no job runs meanwhile */
    for (;;) {
        if (!spin_until(&pool.gen, seen, 0)) {
            pthread_mutex_lock(&pool.mu);
            pool.sleepers++;
            while (atomic_load_explicit(&pool.gen, memory_order_acquire) == seen) pthread_cond_wait(&pool.go, &pool.mu);
            pool.sleepers--;
            pthread_mutex_unlock(&pool.mu);
        }
        seen = atomic_load_explicit(&pool.gen, memory_order_acquire);
        if (atomic_load_explicit(&pool.stop, memory_order_relaxed)) break;
        take_parts(i, (uint32_t)seen);
    }
    return NULL;
}

/* a new generation: a job cut into `parts` (at most MAX_PARTS; j NULL: the workers stop) -> its tag */
static uint32_t pool_publish(const job_t *j, int64_t parts) {
    const uint64_t g = atomic_load_explicit(&pool.gen, memory_order_relaxed) + 1; /* (only the caller publishes) */
    atomic_store_explicit(&pool.stop, j == NULL, memory_order_relaxed);
    atomic_store_explicit(&pool.job, j, memory_order_relaxed);
    atomic_store_explicit(&pool.pending, (uint64_t)parts, memory_order_relaxed);
    atomic_store_explicit(&pool.next, (uint64_t)(uint32_t)g << 32 | (uint64_t)parts << 16, memory_order_release);
    atomic_store_explicit(&pool.gen, g, memory_order_release);
    pthread_mutex_lock(&pool.mu); /* a worker checks gen under mu before it sleeps: none is missed */
    if (pool.sleepers) pthread_cond_broadcast(&pool.go);
    pthread_mutex_unlock(&pool.mu);
    return (uint32_t)g;
}

/* the caller holds no lock; -> 0, or -1 (no memory: run on one thread) */
static int pool_start(int64_t scratch_per) {
    if (pool.pid != getpid()) { /* first use, or a forked child: no workers of ours exist */
        pthread_mutex_init(&pool.mu, NULL);
        pthread_cond_init(&pool.go, NULL);
        pthread_cond_init(&pool.done, NULL);
        pool.n = 1, pool.scratch = NULL, pool.scratch_per = 0, pool.scratch_n = 0;
        pool.sleepers = 0, pool.waiting = 0;
        atomic_store(&pool.gen, 0);
        atomic_store(&pool.next, 0);
        atomic_store(&pool.pending, 0);
        memset(pool.taken, 0, sizeof pool.taken);
        pool.pid = getpid();
        const char *env = getenv("MLX_FLASH_KERNEL_SPIN_US");
        pool.spin_ns = env && *env ? (int64_t)(atof(env) * 1000) : SPIN_NS;
        pool.pin = pin_wanted();
        pool.caller_cpu = -1;
    }
    const int want = pool.want > 0 ? pool.want : 1;
    if (pool.n != want) { /* stop the old workers, start the new */
        if (pool.n > 1) {
            pool_publish(NULL, 0);
            for (int i = 1; i < pool.n; i++) pthread_join(pool.th[i], NULL);
        }
        pool.n = 1;
        pool.caller_cpu = -1; /* new workers: placed by the next shared call */
#ifdef __linux__
        if (sched_getaffinity(0, sizeof pin_allowed, &pin_allowed)) pool.pin = 0; /* (this thread's) */
        for (int i = 0; i < MAX_THREADS; i++) worker_cpu[i] = -1;
#endif
        atomic_store(&pool.stop, 0);
        memset(pool.taken, 0, sizeof pool.taken);
        pool.start_gen = atomic_load(&pool.gen); /* new workers wait for the next generation */
        for (int i = 1; i < want; i++) {
            if (pthread_create(&pool.th[i], NULL, worker, (void *)(intptr_t)i)) break;
#ifdef __linux__
            /* named here, not by the worker: a call may finish before a new worker has run */
            pthread_setname_np(pool.th[i], "mlxf-kernels"); /* (top -H, the pinning test) */
#endif
            pool.n = i + 1;
        }
    }
    if (scratch_per > pool.scratch_per || pool.n > pool.scratch_n) {
        if (scratch_per < pool.scratch_per) scratch_per = pool.scratch_per;
        float *s = malloc(sizeof(float) * (size_t)(scratch_per * pool.n));
        if (!s) return -1;
        free(pool.scratch);
        pool.scratch = s, pool.scratch_per = scratch_per, pool.scratch_n = pool.n;
    }
    return 0;
}

/* the parts a shared job is cut into: over columns one a thread; over rows parts_per a thread,
 * each of PART_MIN_WORK multiply-adds or more, at least one a thread, no more than its rows */
static int64_t job_parts(const job_t *j, int64_t work, int cols) {
    if (cols) return pool.n;
    int64_t parts = (int64_t)pool.n * (pool.parts_per > 0 ? pool.parts_per : PARTS_PER_THREAD);
    if (parts > work / PART_MIN_WORK) parts = work / PART_MIN_WORK;
    if (parts > j->n) parts = j->n;
    if (parts > MAX_PARTS) parts = MAX_PARTS;
    return parts > pool.n ? parts : pool.n;
}

static void run_job(const job_t *j) {
    /* sharing out costs a few microseconds with the workers spinning (more when they sleep):
     * worth it from ~1M weights (a 576 x 576 matvec runs faster on the caller's thread alone) */
    const int pass = j->kind == QMM_ROWS || j->kind == QMM_COLS || j->kind == GATHER_MM || j->kind == GATHER_MM_COLS;
    const int cols = j->kind == GATHER_AXPY || j->kind == QAXPY_COLS || j->kind == QMM_COLS || j->kind == GATHER_MM_COLS;
    const int64_t work = (cols ? j->m : j->n) * j->k * (pass ? j->pos : 1);
    const int par = pool.n > 1 && j->n >= 4 * pool.n && work >= PAR_MIN_WORK;
    if (!par) {
        run_part(j, 0, 0, 1); /* every row on the caller's thread */
        return;
    }
    pin_workers();
    take_parts(0, pool_publish(j, job_parts(j, work, cols)));
    if (!spin_until(&pool.pending, 0, 1)) {
        pthread_mutex_lock(&pool.mu);
        pool.waiting = 1;
        while (atomic_load_explicit(&pool.pending, memory_order_acquire)) pthread_cond_wait(&pool.done, &pool.mu);
        pool.waiting = 0;
        pthread_mutex_unlock(&pool.mu);
    }
}

/* ---- Python */

static pthread_mutex_t calls = PTHREAD_MUTEX_INITIALIZER;

/* fork() keeps only the forking thread. Were `calls` held then by another thread's product (its
 * GIL released), the child's first product would wait on it forever; so a fork waits for the
 * product in flight (pthread_atfork: `calls` taken before, let go after on both sides). The
 * pool's own lock and threads the child makes anew (pool_start). */
static void fork_prepare(void) { pthread_mutex_lock(&calls); }
static void fork_release(void) { pthread_mutex_unlock(&calls); }

/* run a job on the pool (scratch: floats per thread), the GIL released; one job at a time:
 * callers on two Python threads take turns. -> 0, or -1 with MemoryError set */
static int dispatch(const job_t *j, int64_t scratch) {
    int started;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&calls);
    started = pool_start(scratch) == 0;
    if (started) run_job(j);
    pthread_mutex_unlock(&calls);
    Py_END_ALLOW_THREADS
    if (!started) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* a pass's x [pos, k] as QMM_* read it: tiles of 16 positions, each [k][16] (positions past
 * pos zero) -> a new allocation (free it), or NULL */
static float *transpose_x(const float *x, int64_t pos, int64_t k) {
    const int64_t tiles = (pos + 15) / 16;
    float *xt = malloc(sizeof(float) * (size_t)(tiles > 0 ? tiles * k * 16 : 1));
    if (!xt) return NULL;
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t b = 0; b < 16; b++) {
                const int64_t p = t * 16 + b;
                xt[(t * k + kk) * 16 + b] = p < pos ? x[p * k + kk] : 0.0f;
            }
    return xt;
}

/* the floats each thread's part of a QMM_* job needs: QMM_ROWS a row's scales and biases and
 * MM16_ROWS dequantized rows; QMM_COLS MM16_KBLOCK columns' values (at most every output: k, a
 * multiple of 32) */
static int64_t qmm_scratch(const job_t *j) {
    return j->kind == QMM_ROWS ? 2 * (j->k / j->g) + MM16_ROWS * (j->k + MM16_PAD) : MM16_KBLOCK * j->k;
}

/* x's group sums */
static void group_sums(const float *xf, int64_t k, int64_t group, float *xsum) {
    for (int64_t g0 = 0; g0 < k; g0 += group) {
        float acc[8] = {0}, t = 0;
        for (int64_t i = 0; i < group; i += 8)
            for (int l = 0; l < 8; l++) acc[l] += xf[g0 + i + l];
        for (int l = 0; l < 8; l++) t += acc[l];
        xsum[g0 / group] = t;
    }
}

/* x as the job's rows read it: its group sums, and for 4- and 8-bit rows its digits (where the
 * AVX-512 VNNI loops run: j's k, bits and simd), else for 4-bit rows its AVX-512 order (the
 * AVX-512 BF16 loop) or its AVX2 order (per 16 values, the 8 even-indexed then the 8 odd), in one
 * allocation -> it (free it after the job), or NULL (no memory) */
static float *prepare_x_for(const job_t *j, const float *xf, xprep_t *in) {
    const int64_t ng = j->k / j->g;
    in->x = xf, in->xp = NULL, in->xe = NULL, in->xd = NULL, in->xs = NULL, in->xunit = 1.0f;
#ifdef VNNI_PATH
    if (j->simd >= 3 && (j->bits == 4 || j->bits == 8) && j->k % 64 == 0) {
        /* the sums, the sums times 2^-E, then the digits at the next multiple of 64 bytes (their
         * loads are aligned) */
        const size_t at = ((size_t)ng * 2 * sizeof(float) + 63) / 64 * 64;
        float *p = NULL;
        if (posix_memalign((void **)&p, 64, at + (size_t)vnni_bytes(j->k, j->bits))) return NULL;
        group_sums(xf, j->k, j->g, p);
        const float unit = prepare_vnni(xf, j->k, j->bits, (uint8_t *)p + at);
        for (int64_t i = 0; i < ng; i++) p[ng + i] = p[i] / unit; /* (a power of two: exact) */
        in->xsum = p, in->xs = p + ng, in->xd = (const uint8_t *)p + at, in->xunit = unit;
        return p;
    }
#endif
    /* after the sums: x in the AVX2 loop's or the AVX-512 loop's order (k floats) */
    float *xsum = malloc(sizeof(float) * (size_t)(ng + j->k));
    if (!xsum) return NULL;
    group_sums(xf, j->k, j->g, xsum);
    in->xsum = xsum;
    float *xp = xsum + ng;
#ifdef BF16_PATH
    if (j->simd >= 2 && j->bits == 4 && j->k % 64 == 0) {
        order_x_avx512(xf, j->k, xp);
        in->xe = xp;
        return xsum;
    }
#endif
    for (int64_t i = 0; i < j->k; i += 16)
        for (int l = 0; l < 8; l++) xp[i + l] = xf[i + 2 * l], xp[i + 8 + l] = xf[i + 2 * l + 1];
    in->xp = xp;
    return xsum;
}

/* a dimension the size checks may multiply without overflow (and divide by): 1 .. 2^30 (a pass's
 * positions: at most 2^20) */
static int sane(long long d) { return d > 0 && d <= (1LL << 30); }

static int valid_width(long long bits, long long group) {
    return (bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8) &&
           (group == 32 || group == 64 || group == 128);
}

/* qmv(x, w, scales, biases, y, n, k, bits, group, scale_code): y[:n] = x @ W.T, x float32 [k];
 * dequantize(None, w, scales, biases, y, ...): y[n, k] = W's values in float32;
 * qmm(x, w, ...): y[pos, n] = x @ W.T for a pass x float32 [pos, k] */
static PyObject *run(PyObject *args, int kind) {
    const char *name = kind == QMV ? "qmv" : kind == DEQUANTIZE ? "dequantize" : "qmm";
    Py_buffer x = {0}, w, s, b, y;
    PyObject *xo;
    long long n, k, bits, group, sc;
    if (!PyArg_ParseTuple(args, "Oy*y*y*w*LLLLL", &xo, &w, &s, &b, &y, &n, &k, &bits, &group, &sc))
        return NULL;
    PyObject *result = NULL;
    float *xsum = NULL;
    if (kind != DEQUANTIZE && PyObject_GetBuffer(xo, &x, PyBUF_SIMPLE) < 0) goto out;
    const int64_t ssz = sc == F32 ? 4 : 2, ng = group > 0 ? k / group : 0, row_bytes = k * bits / 8;
    const int64_t pos = kind == QMM_ROWS && sane(k) ? x.len / (4 * k) : 1;
    const int ok = valid_width(bits, group) && sc >= F32 && sc <= BF16 && n >= 0 && n <= (1LL << 30) && sane(k) &&
                   pos <= (1 << 20) && k % group == 0 && w.len == n * row_bytes && s.len == n * ng * ssz &&
                   b.len == n * ng * ssz && y.len == n * 4 * (kind == DEQUANTIZE ? k : pos) &&
                   ((uintptr_t)y.buf % 4) == 0 &&
                   (kind == DEQUANTIZE || (x.len == pos * k * 4 && ((uintptr_t)x.buf % 4) == 0));
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "%s: arguments of the wrong size or kind", name);
        goto out;
    }
    job_t j = {w.buf, s.buf, b.buf, NULL, y.buf, n, k, group, bits, sc, row_bytes, use_simd,
               kind, NULL, NULL, 0, ng * ssz, ng * ssz, NULL, NULL, NULL, 0, 0};
    if (kind == QMV && !(xsum = prepare_x_for(&j, (const float *)x.buf, &j.in))) {
        PyErr_NoMemory();
        goto out;
    }
    if (kind == QMM_ROWS) {
        if (!(xsum = transpose_x((const float *)x.buf, pos, k))) {
            PyErr_NoMemory();
            goto out;
        }
        j.xt = xsum, j.pos = pos, j.ldy = n;
    }
    if (dispatch(&j, kind == QMM_ROWS ? qmm_scratch(&j) : 2 * ng) < 0) goto out;
    result = Py_None;
    Py_INCREF(result);
out:
    free(xsum);
    if (x.obj) PyBuffer_Release(&x);
    PyBuffer_Release(&w);
    PyBuffer_Release(&s);
    PyBuffer_Release(&b);
    PyBuffer_Release(&y);
    return result;
}

static PyObject *py_qmv(PyObject *mod, PyObject *args) {
    (void)mod;
    return run(args, QMV);
}

static PyObject *py_dequantize(PyObject *mod, PyObject *args) {
    (void)mod;
    return run(args, DEQUANTIZE);
}

static PyObject *py_qmm(PyObject *mod, PyObject *args) {
    (void)mod;
    return run(args, QMM_ROWS);
}

/* the selected rows of a buffer, each [packed values | scales | biases]:
 *   qmv_rows(x, buf, row_stride, scales_off, biases_off, sel, y, k, bits, group, scale_code):
 *     y[i] = x . row sel[i] (values, then its k / group scales and biases at their offsets)
 *   dequantize_rows(None, buf, ...the same...): y[i] = row sel[i]'s values, float32 [len(sel), k]
 *   qmm_rows(x, buf, ...the same...): y[b, i] = x[b] . row sel[i], a pass x float32 [pos, k]
 * sel int64; every index checked against the buffer. */
static PyObject *strided_rows(PyObject *args, int kind) {
    const char *name = kind == QMV ? "qmv_rows" : kind == DEQUANTIZE ? "dequantize_rows" : "qmm_rows";
    Py_buffer x = {0}, w, sel, y;
    PyObject *xo;
    long long stride, soff, boff, k, bits, group, sc;
    if (!PyArg_ParseTuple(args, "Oy*LLLy*w*LLLL", &xo, &w, &stride, &soff, &boff, &sel, &y, &k, &bits, &group, &sc))
        return NULL;
    PyObject *result = NULL;
    float *xsum = NULL;
    if (kind != DEQUANTIZE && PyObject_GetBuffer(xo, &x, PyBUF_SIMPLE) < 0) goto out;
    const int64_t m = sel.len / 8, ssz = sc == F32 ? 4 : 2, ng = group > 0 ? k / group : 0;
    const int64_t pos = kind == QMM_ROWS && sane(k) ? x.len / (4 * k) : 1;
    const int64_t rows = stride > 0 ? w.len / stride : 0;
    int ok = valid_width(bits, group) && sc >= F32 && sc <= BF16 && sane(k) && pos <= (1 << 20) && k % group == 0 &&
             sel.len % 8 == 0 && stride >= k * bits / 8 && soff >= k * bits / 8 && soff + ng * ssz <= stride &&
             boff >= 0 && boff + ng * ssz <= stride && ((uintptr_t)y.buf % 4) == 0 &&
             ((uintptr_t)sel.buf % 8) == 0 &&
             (kind == DEQUANTIZE ? y.len == 4 * m * k
                                 : x.len == 4 * k * pos && y.len == 4 * m * pos && ((uintptr_t)x.buf % 4) == 0);
    const int64_t *ids = (const int64_t *)sel.buf;
    for (int64_t i = 0; ok && i < m; i++) ok = ids[i] >= 0 && ids[i] < rows;
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "%s: arguments of the wrong size or kind (or a row out of range)", name);
        goto out;
    }
    job_t j;
    memset(&j, 0, sizeof j);
    j.w = w.buf, j.s = (const uint8_t *)w.buf + soff, j.b = (const uint8_t *)w.buf + boff, j.y = y.buf;
    j.n = m, j.k = k, j.g = group, j.bits = bits, j.scode = sc, j.row_bytes = stride, j.s_stride = stride;
    j.b_stride = stride, j.simd = use_simd, j.kind = kind, j.sel = ids;
    if (kind == QMV && !(xsum = prepare_x_for(&j, x.buf, &j.in))) {
        PyErr_NoMemory();
        goto out;
    }
    if (kind == QMM_ROWS) {
        if (!(xsum = transpose_x(x.buf, pos, k))) {
            PyErr_NoMemory();
            goto out;
        }
        j.xt = xsum, j.pos = pos, j.ldy = m;
    }
    if (dispatch(&j, kind == QMM_ROWS ? qmm_scratch(&j) : 2 * ng) < 0) goto out;
    result = Py_None;
    Py_INCREF(result);
out:
    free(xsum);
    if (x.obj) PyBuffer_Release(&x);
    PyBuffer_Release(&w);
    PyBuffer_Release(&sel);
    PyBuffer_Release(&y);
    return result;
}

static PyObject *py_qmv_rows(PyObject *mod, PyObject *args) {
    (void)mod;
    return strided_rows(args, QMV);
}

static PyObject *py_dequantize_rows(PyObject *mod, PyObject *args) {
    (void)mod;
    return strided_rows(args, DEQUANTIZE);
}

static PyObject *py_qmm_rows(PyObject *mod, PyObject *args) {
    (void)mod;
    return strided_rows(args, QMM_ROWS);
}

/* the selected packed columns of a buffer, whose value c is scales[trow[i], c] * q + biases[trow[i], c]
 * (tables [T, k] C-contiguous):
 *   qaxpy_cols(h, buf, row_stride, sel, trow, scales, biases, y, k, bits, scale_code, accumulate=0):
 *     y = sum_i h[i] * column sel[i] (rows ordered by trow); accumulate: y += that, the rows'
 *     terms added to y in the same order as if they followed the rows that made y
 *   dequantize_cols(None, buf, ...the same...): y[i] = column sel[i]'s values, float32 [len(sel), k]
 *   qmm_cols(h, buf, ...the same..., accumulate=0): y[b] = sum_i h[b, i] * column sel[i] for a pass
 *     h float32 [pos, len(sel)], y [pos, k] (any row order; accumulate: y += that)
 * sel, trow int64; every index checked against the buffer and the tables. */
static PyObject *table_cols(PyObject *args, int kind) {
    const char *name = kind == QAXPY_COLS ? "qaxpy_cols" : kind == DEQUANT_COLS ? "dequantize_cols" : "qmm_cols";
    Py_buffer h = {0}, w, sel, trow, ts, tb, y;
    PyObject *ho;
    long long stride, k, bits, sc;
    int accumulate = 0;
    if (!PyArg_ParseTuple(args, "Oy*Ly*y*y*y*w*LLL|p", &ho, &w, &stride, &sel, &trow, &ts, &tb, &y, &k, &bits, &sc,
                          &accumulate))
        return NULL;
    PyObject *result = NULL;
    float *xt = NULL;
    if (kind != DEQUANT_COLS && PyObject_GetBuffer(ho, &h, PyBUF_SIMPLE) < 0) goto out;
    const int64_t m = sel.len / 8, ssz = sc == F32 ? 4 : 2, rows = stride > 0 ? w.len / stride : 0;
    const int64_t pos = kind == QMM_COLS && sane(k) ? y.len / (4 * k) : 1;
    const int64_t trows = sane(k) ? ts.len / (k * ssz) : 0;
    int ok = valid_width(bits, 32) && sc >= F32 && sc <= BF16 && sane(k) && pos <= (1 << 20) && k % 32 == 0 &&
             sel.len % 8 == 0 &&
             trow.len == sel.len && stride >= k * bits / 8 && ts.len == trows * k * ssz && tb.len == ts.len &&
             ((uintptr_t)y.buf % 4) == 0 && ((uintptr_t)sel.buf % 8) == 0 && ((uintptr_t)trow.buf % 8) == 0 &&
             (kind == DEQUANT_COLS ? y.len == 4 * m * k
                                   : h.len == 4 * m * pos && y.len == 4 * k * pos && ((uintptr_t)h.buf % 4) == 0);
    const int64_t *ids = (const int64_t *)sel.buf, *tr = (const int64_t *)trow.buf;
    for (int64_t i = 0; ok && i < m; i++)
        ok = ids[i] >= 0 && ids[i] < rows && tr[i] >= 0 && tr[i] < trows &&
             (kind != QAXPY_COLS || i == 0 || tr[i] >= tr[i - 1]);
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "%s: arguments of the wrong size or kind (or an index out of range%s)",
                     name, kind == QAXPY_COLS ? ", or rows not ordered by table row" : "");
        goto out;
    }
    job_t j;
    memset(&j, 0, sizeof j);
    j.w = w.buf, j.row_bytes = stride, j.sel = ids, j.trow = tr, j.m = m, j.h = h.buf, j.y = y.buf;
    j.ts = ts.buf, j.tb = tb.buf, j.t_stride = k * ssz, j.scode = sc, j.bits = bits, j.k = k, j.kind = kind;
    j.n = kind == DEQUANT_COLS ? m : k, j.simd = use_simd; /* QAXPY_COLS, QMM_COLS cut columns into parts */
    j.accumulate = kind != DEQUANT_COLS && accumulate;
    if (kind == QMM_COLS) {
        if (m == 0) { /* no columns: y is zeros, or as it was */
            if (!accumulate) memset(y.buf, 0, (size_t)y.len);
            result = Py_None;
            Py_INCREF(result);
            goto out;
        }
        if (!(xt = transpose_x(h.buf, pos, m))) {
            PyErr_NoMemory();
            goto out;
        }
        j.xt = xt, j.pos = pos, j.ldy = k;
    }
#ifdef VNNI_COLS_PATH
    colprep_t prep = {0};
    if (kind == QAXPY_COLS && use_simd >= 3 && use_vbmi && (bits == 4 || bits == 8) &&
        prepare_cols_vnni(h.buf, ids, tr, m, &prep) == 0)
        j.cols_prep = &prep;
#endif
    const int failed = dispatch(&j, kind == QAXPY_COLS ? 2 * k : kind == QMM_COLS ? qmm_scratch(&j) : 0) < 0;
#ifdef VNNI_COLS_PATH
    free_cols_vnni(&prep);
#endif
    if (failed) goto out;
    result = Py_None;
    Py_INCREF(result);
out:
    free(xt);
    if (h.obj) PyBuffer_Release(&h);
    PyBuffer_Release(&w);
    PyBuffer_Release(&sel);
    PyBuffer_Release(&trow);
    PyBuffer_Release(&ts);
    PyBuffer_Release(&tb);
    PyBuffer_Release(&y);
    return result;
}

static PyObject *py_qaxpy_cols(PyObject *mod, PyObject *args) {
    (void)mod;
    return table_cols(args, QAXPY_COLS);
}

static PyObject *py_dequantize_cols(PyObject *mod, PyObject *args) {
    (void)mod;
    return table_cols(args, DEQUANT_COLS);
}

static PyObject *py_qmm_cols(PyObject *mod, PyObject *args) {
    (void)mod;
    return table_cols(args, QMM_COLS);
}

#define MAX_MANY 64

/* qmv_many(xs, ws, ss, bs, x_of, y, n, k, bits, group, scale_code): M matrices [n, k] alike
 * (tuples ws, ss, bs: packed words, scales, biases of each), matrix i times xs[x_of[i]]
 * (xs: a tuple of float32 [k]) -> y[i] (y float32 [M, n]), in one job shared out by rows:
 * a layer's routed experts (gate and up on one x, then down on each expert's h) in two calls
 * instead of three per expert, each x prepared once. */
static PyObject *py_qmv_many(PyObject *mod, PyObject *args) {
    PyObject *xs, *ws, *ss, *bs, *xof;
    Py_buffer y, xb[MAX_MANY], wb[MAX_MANY], sb[MAX_MANY], bb[MAX_MANY];
    long long n, k, bits, group, sc;
    (void)mod;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!w*LLLLL", &PyTuple_Type, &xs, &PyTuple_Type, &ws, &PyTuple_Type, &ss,
                          &PyTuple_Type, &bs, &PyTuple_Type, &xof, &y, &n, &k, &bits, &group, &sc))
        return NULL;
    PyObject *result = NULL;
    const Py_ssize_t m = PyTuple_GET_SIZE(ws), nx = PyTuple_GET_SIZE(xs);
    Py_ssize_t got_x = 0, got_w = 0;
    float *bufs[MAX_MANY] = {0};
    xprep_t in[MAX_MANY];
    mat_t mats[MAX_MANY];
    const int64_t ssz = sc == F32 ? 4 : 2, ng = group > 0 && k > 0 ? k / group : 0, row_bytes = k * bits / 8;
    int ok = m >= 1 && m <= MAX_MANY && nx >= 1 && nx <= m && PyTuple_GET_SIZE(ss) == m &&
             PyTuple_GET_SIZE(bs) == m && PyTuple_GET_SIZE(xof) == m && valid_width(bits, group) && sc >= F32 &&
             sc <= BF16 && n > 0 && k > 0 && k % group == 0 && y.len == m * n * 4 && ((uintptr_t)y.buf % 4) == 0;
    for (; ok && got_x < nx; got_x++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(xs, got_x), &xb[got_x], PyBUF_SIMPLE) < 0) goto out;
        ok = xb[got_x].len == 4 * k && ((uintptr_t)xb[got_x].buf % 4) == 0;
    }
    for (; ok && got_w < m; got_w++) {
        const Py_ssize_t i = got_w;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(ws, i), &wb[i], PyBUF_SIMPLE) < 0) goto out;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(ss, i), &sb[i], PyBUF_SIMPLE) < 0) {
            PyBuffer_Release(&wb[i]);
            goto out;
        }
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(bs, i), &bb[i], PyBUF_SIMPLE) < 0) {
            PyBuffer_Release(&wb[i]);
            PyBuffer_Release(&sb[i]);
            goto out;
        }
        const long xi = PyLong_AsLong(PyTuple_GET_ITEM(xof, i));
        ok = wb[i].len == n * row_bytes && sb[i].len == n * ng * ssz && bb[i].len == n * ng * ssz && xi >= 0 &&
             xi < nx;
        mats[i].w = wb[i].buf, mats[i].s = sb[i].buf, mats[i].b = bb[i].buf;
        mats[i].in = &in[ok ? xi : 0], mats[i].y = (float *)y.buf + i * n;
    }
    if (!ok) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "qmv_many: arguments of the wrong size or kind");
        goto out;
    }
    job_t j;
    memset(&j, 0, sizeof j);
    j.n = m * n, j.per = n, j.k = k, j.g = group, j.bits = bits, j.scode = sc, j.row_bytes = row_bytes;
    j.s_stride = ng * ssz, j.b_stride = ng * ssz, j.simd = use_simd, j.kind = QMV_MANY, j.mats = mats;
    for (Py_ssize_t i = 0; i < nx; i++)
        if (!(bufs[i] = prepare_x_for(&j, xb[i].buf, &in[i]))) {
            PyErr_NoMemory();
            goto out;
        }
    if (dispatch(&j, 2 * ng) < 0) goto out;
    result = Py_None;
    Py_INCREF(result);
out:
    for (Py_ssize_t i = 0; i < got_x; i++) { /* (bufs: set only once every x was taken) */
        free(bufs[i]);
        PyBuffer_Release(&xb[i]);
    }
    for (Py_ssize_t i = 0; i < got_w; i++) {
        PyBuffer_Release(&wb[i]);
        PyBuffer_Release(&sb[i]);
        PyBuffer_Release(&bb[i]);
    }
    PyBuffer_Release(&y);
    return result;
}

/* gather_mv(x, W, sel, y, k, _, code=0): y[i] = W[sel[i]] . x; gather_axpy(h, W, sel, y, k,
 * accumulate=0, code=0): y = sum_i h[i] W[sel[i]] (accumulate: y += that, in the order
 * qaxpy_cols's accumulate keeps). W [rows, k] (C order): float32 (code 0), or the uint16 bits
 * of float16 (1) / bfloat16 (2), each value converted as it is read, the sums those of the
 * float32 rows; sel int64 (each in 0 .. rows-1), x / y float32.
 * A pass of several positions (a batch's decode step), each row converted once, into a tile,
 * for all of them (gemm16.h's tiles, as qmm_rows / qmm_cols):
 *   gather_mm(x, W, sel, y, k, _, code=0): y[b, i] = W[sel[i]] . x[b], x [pos, k], y [pos, len(sel)]
 *   gather_mm_cols(h, W, sel, y, k, accumulate=0, code=0): y[b] (+)= sum_i h[b, i] W[sel[i]],
 *     h [pos, len(sel)] (len(sel) > 0), y [pos, k] */
static PyObject *gather(PyObject *args, int kind) {
    static const char *names[] = {[GATHER_MV] = "gather_mv", [GATHER_AXPY] = "gather_axpy",
                                  [GATHER_MM] = "gather_mm", [GATHER_MM_COLS] = "gather_mm_cols"};
    Py_buffer v, w, sel, y;
    long long k;
    int accumulate = 0, code = F32;
    if (!PyArg_ParseTuple(args, "y*y*y*w*L|pi", &v, &w, &sel, &y, &k, &accumulate, &code)) return NULL;
    PyObject *result = NULL;
    float *xt = NULL;
    const int64_t vb = code == F32 ? 4 : 2; /* bytes a value of W */
    const int64_t m = sel.len / 8, rows = k > 0 ? w.len / (vb * k) : 0;
    /* a pass's positions: x's length over its row's (k, or a value a selected row) */
    const int64_t row = kind == GATHER_MM ? k : m;
    const int64_t pos = (kind == GATHER_MM || kind == GATHER_MM_COLS) && row > 0 && sane(k) ? v.len / (4 * row) : 1;
    int ok = sane(k) && (code == F32 || code == F16 || code == BF16) && w.len == rows * vb * k && sel.len % 8 == 0 &&
             ((uintptr_t)w.buf % vb) == 0 &&
             ((uintptr_t)sel.buf % 8) == 0 && ((uintptr_t)v.buf % 4) == 0 && ((uintptr_t)y.buf % 4) == 0 &&
             m <= (1LL << 30) && pos >= 1 && pos <= (1 << 20);
    if (ok) {
        if (kind == GATHER_MV) ok = v.len == 4 * k && y.len == 4 * m;
        else if (kind == GATHER_AXPY) ok = v.len == 4 * m && y.len == 4 * k;
        else if (kind == GATHER_MM) ok = v.len == 4 * k * pos && y.len == 4 * m * pos;
        else ok = m > 0 && v.len == 4 * m * pos && y.len == 4 * k * pos;
    }
    const int64_t *ids = (const int64_t *)sel.buf;
    for (int64_t i = 0; ok && i < m; i++) ok = ids[i] >= 0 && ids[i] < rows;
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "%s: arguments of the wrong size or kind (or a row out of range)", names[kind]);
        goto out;
    }
    job_t j;
    memset(&j, 0, sizeof j);
    j.w = w.buf, j.row_bytes = vb * k, j.k = k, j.sel = ids, j.m = m, j.y = y.buf, j.simd = use_simd, j.kind = kind;
    j.scode = code;
    j.accumulate = (kind == GATHER_AXPY || kind == GATHER_MM_COLS) && accumulate;
    int64_t scratch = 0;
    if (kind == GATHER_MV)
        j.x = v.buf, j.n = m;
    else if (kind == GATHER_AXPY)
        j.h = v.buf, j.n = k;
    else {
        if (!(xt = transpose_x((const float *)v.buf, pos, row))) {
            PyErr_NoMemory();
            goto out;
        }
        j.xt = xt, j.pos = pos;
        j.n = kind == GATHER_MM ? m : k;
        j.ldy = kind == GATHER_MM ? m : k;
        /* GATHER_MM: MM16_ROWS rows of the tile; GATHER_MM_COLS: MM16_KBLOCK columns' values, at
         * most every output (k, in whole blocks of 16) */
        scratch = kind == GATHER_MM ? MM16_ROWS * (k + MM16_PAD) : MM16_KBLOCK * ((k + 15) & ~(int64_t)15);
    }
    if (dispatch(&j, scratch) < 0) goto out;
    result = Py_None;
    Py_INCREF(result);
out:
    free(xt);
    PyBuffer_Release(&v);
    PyBuffer_Release(&w);
    PyBuffer_Release(&sel);
    PyBuffer_Release(&y);
    return result;
}

static PyObject *py_gather_mv(PyObject *mod, PyObject *args) {
    (void)mod;
    return gather(args, GATHER_MV);
}

static PyObject *py_gather_axpy(PyObject *mod, PyObject *args) {
    (void)mod;
    return gather(args, GATHER_AXPY);
}

static PyObject *py_gather_mm(PyObject *mod, PyObject *args) {
    (void)mod;
    return gather(args, GATHER_MM);
}

static PyObject *py_gather_mm_cols(PyObject *mod, PyObject *args) {
    (void)mod;
    return gather(args, GATHER_MM_COLS);
}

/* set_threads(n): the pool's size for the next call (1: the caller's thread alone) */
static PyObject *py_set_threads(PyObject *mod, PyObject *args) {
    int n;
    (void)mod;
    if (!PyArg_ParseTuple(args, "i", &n)) return NULL;
    if (n < 1 || n > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "threads must be 1 .. %d", MAX_THREADS);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&calls); /* (pool_start reads it under this lock) */
    pool.want = n;
    pthread_mutex_unlock(&calls);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* set_pinning(on) -> whether the workers are pinned from now on (Linux only: 0 elsewhere) */
static PyObject *py_set_pinning(PyObject *mod, PyObject *args) {
    int on;
    (void)mod;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&calls); /* no call runs meanwhile */
#ifdef __linux__
    pin_request = on;
    if (pool.pid == getpid()) { /* (else the pool's start takes pin_request) */
        if (pool.pin && !on) unpin_workers();
        pool.pin = on;
        pool.caller_cpu = -1;
    }
#endif
    pthread_mutex_unlock(&calls);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(pin_wanted());
}

/* set_parts(n) -> n: the parts a thread a shared job over rows is cut into from now on (1 .. 64;
 * 0: the default, PARTS_PER_THREAD), each still of PART_MIN_WORK multiply-adds or more (the A/B
 * scripts); a job over columns keeps one a thread */
static PyObject *py_set_parts(PyObject *mod, PyObject *args) {
    int n;
    (void)mod;
    if (!PyArg_ParseTuple(args, "i", &n)) return NULL;
    if (n < 0 || n > 64) {
        PyErr_SetString(PyExc_ValueError, "parts a thread must be 0 (the default) .. 64");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&calls); /* no call runs meanwhile */
    pool.parts_per = n;
    pthread_mutex_unlock(&calls);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(n ? n : PARTS_PER_THREAD);
}

/* parts_taken() -> the parts each thread of the pool ran since it started (the caller's first;
 * products run on the caller alone are not counted): the tests see the parts go to the thread
 * that runs */
static PyObject *py_parts_taken(PyObject *mod, PyObject *unused) {
    (void)mod, (void)unused;
    int64_t taken[MAX_THREADS];
    int n = 1;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&calls); /* no call runs meanwhile */
    memset(taken, 0, sizeof taken);
    if (pool.pid == getpid()) n = pool.n, memcpy(taken, pool.taken, sizeof taken);
    pthread_mutex_unlock(&calls);
    Py_END_ALLOW_THREADS
    PyObject *out = PyTuple_New(n);
    for (int i = 0; out && i < n; i++) {
        PyObject *v = PyLong_FromLongLong(taken[i]);
        if (!v) Py_CLEAR(out);
        else PyTuple_SET_ITEM(out, i, v);
    }
    return out;
}

/* pinning() -> whether the workers are pinned (set_pinning, MLX_FLASH_KERNEL_PIN, a refused
 * placement), or will be when the pool starts (at the first shared product) */
static PyObject *py_pinning(PyObject *mod, PyObject *unused) {
    (void)mod, (void)unused;
    int on;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&calls); /* (a call may be starting the pool) */
    on = pool.pid == getpid() ? pool.pin : pin_wanted();
    pthread_mutex_unlock(&calls);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(on);
}

/* threads() -> the pool's size for the next call, as set_threads left it (0: never set, 1 used) */
static PyObject *py_threads(PyObject *mod, PyObject *unused) {
    (void)mod, (void)unused;
    int n;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&calls);
    n = pool.want;
    pthread_mutex_unlock(&calls);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(n);
}

/* simd(level) -> the level in use: 0 the portable loops, 1 AVX2, 2 AVX-512 BF16 for 4-bit
 * products (AVX2 for the rest), 3 AVX-512 VNNI for 4- and 8-bit products (level 2 for the rest);
 * a level above the CPU's gives the CPU's; level < 0 asks */
static PyObject *py_simd(PyObject *mod, PyObject *args) {
    int flag;
    (void)mod;
    if (!PyArg_ParseTuple(args, "i", &flag)) return NULL;
    if (flag >= 0) {
        const int top = cpu_simd();
        use_simd = flag < top ? flag : top;
    }
    return PyLong_FromLong(use_simd);
}

static PyMethodDef methods[] = {
    {"qmv", py_qmv, METH_VARARGS, "qmv(x, w, scales, biases, y, n, k, bits, group, scale_code)"},
    {"dequantize", py_dequantize, METH_VARARGS,
     "dequantize(None, w, scales, biases, y, n, k, bits, group, scale_code)"},
    {"qmv_rows", py_qmv_rows, METH_VARARGS,
     "qmv_rows(x, buf, row_stride, scales_off, biases_off, sel, y, k, bits, group, scale_code)"},
    {"qaxpy_cols", py_qaxpy_cols, METH_VARARGS,
     "qaxpy_cols(h, buf, row_stride, sel, trow, scales, biases, y, k, bits, scale_code)"},
    {"dequantize_rows", py_dequantize_rows, METH_VARARGS,
     "dequantize_rows(None, buf, row_stride, scales_off, biases_off, sel, y, k, bits, group, scale_code)"},
    {"dequantize_cols", py_dequantize_cols, METH_VARARGS,
     "dequantize_cols(None, buf, row_stride, sel, trow, scales, biases, y, k, bits, scale_code)"},
    {"qmm", py_qmm, METH_VARARGS, "qmm(x, w, scales, biases, y, n, k, bits, group, scale_code): y = x @ W.T, x [pos, k]"},
    {"qmm_rows", py_qmm_rows, METH_VARARGS,
     "qmm_rows(x, buf, row_stride, scales_off, biases_off, sel, y, k, bits, group, scale_code), x [pos, k]"},
    {"qmm_cols", py_qmm_cols, METH_VARARGS,
     "qmm_cols(h, buf, row_stride, sel, trow, scales, biases, y, k, bits, scale_code, accumulate=0), h [pos, m]"},
    {"qmv_many", py_qmv_many, METH_VARARGS, "qmv_many(xs, ws, ss, bs, x_of, y, n, k, bits, group, scale_code)"},
    {"gather_mv", py_gather_mv, METH_VARARGS, "gather_mv(x, W, sel, y, k): y[i] = W[sel[i]] . x"},
    {"gather_axpy", py_gather_axpy, METH_VARARGS, "gather_axpy(h, W, sel, y, k): y = sum_i h[i] W[sel[i]]"},
    {"gather_mm", py_gather_mm, METH_VARARGS, "gather_mm(x, W, sel, y, k): y[b, i] = W[sel[i]] . x[b], a pass x [pos, k]"},
    {"gather_mm_cols", py_gather_mm_cols, METH_VARARGS,
     "gather_mm_cols(h, W, sel, y, k, accumulate=0): y[b] = sum_i h[b, i] W[sel[i]], a pass h [pos, len(sel)]"},
    {"set_threads", py_set_threads, METH_VARARGS, "set_threads(n)"},
    {"threads", py_threads, METH_NOARGS, "threads() -> the pool's size (0: never set)"},
    {"set_pinning", py_set_pinning, METH_VARARGS, "set_pinning(on) -> whether the workers are pinned (Linux)"},
    {"set_parts", py_set_parts, METH_VARARGS, "set_parts(n) -> the parts a thread a shared job over rows is cut into (0: the default)"},
    {"parts_taken", py_parts_taken, METH_NOARGS, "parts_taken() -> the parts each thread ran since the pool started"},
    {"pinning", py_pinning, METH_NOARGS, "pinning() -> whether the workers are pinned (or will be)"},
    {"simd", py_simd, METH_VARARGS, "simd(level) -> the level in use: 0 portable, 1 AVX2, 2 AVX-512 BF16, 3 AVX-512 VNNI (level < 0: ask)"},
    {NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_matvec", "matrix-vector products on the CPU: quantized, and over chosen rows", -1, methods};

PyMODINIT_FUNC PyInit__matvec(void) {
    use_simd = cpu_simd();
#ifdef VNNI_COLS_PATH
    use_vbmi = use_simd >= 3 && cpu_vbmi();
#endif
    static int at_fork; /* (once a process: twice, prepare would take `calls` twice) */
    if (!at_fork) {
        if (pthread_atfork(fork_prepare, fork_release, fork_release)) {
            PyErr_SetString(PyExc_OSError, "pthread_atfork failed");
            return NULL;
        }
        at_fork = 1;
    }
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "MAX_MANY", MAX_MANY) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
