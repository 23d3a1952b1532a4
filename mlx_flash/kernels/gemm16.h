/* The pass kernels' products, included by _matvec.c after quant.h, avx512.h and its AVX2
 * helpers (F32, F16, TARGET_AVX512_BF16, AVX2): a decode step of several sequences (a batch:
 * up to kernels.BATCH_PASS positions, in tiles of 16) multiplies every weight, dequantized
 * once, into every position.
 *
 * Why: a batch's decode step multiplies every weight by 16 vectors. Dequantized chunks
 * through BLAS ran at ~22 G multiply-adds/s on two Zen 4 cores (OpenBLAS's sgemm at M = 16
 * packs the weights before it multiplies them, and MLX evaluates each chunk apart), where a
 * 4-bit OPT-6.7B step is 106 G. Here x is transposed once a call (xt [k][16], zero-padded),
 * so a 512-bit register holds one column of x for all 16 positions, and each weight is one
 * broadcast multiply-add into them (58 G/s on one Zen 4 core, the core's peak).
 *
 * The tiles take float32 rows: the quantized kernels (qmm_rows, qmm_cols) dequantize into them,
 * the 16-bit ones (gather_mm, gather_mm_cols: weights held at float16 / bfloat16, or float32
 * rows) convert into them.
 *
 * Two tiles, one per layout a step meets:
 * - mm16_tile, rows of W (x @ W.T: gate, up, attention, the output head): MM16_ROWS rows
 *   dequantized into a tile, a register per row holding its 16 positions; each row's sum in
 *   runs of MM16_RUN values, each run in a register of its own and then added to the total
 *   (as the one-position kernels sum a group, then the groups).
 * - mm16_cols, W [m, d] itself (h @ W: the FFN's down columns): MM16_KBLOCK columns
 *   dequantized into a blocked tile, 16 outputs a register, a register a position; each
 *   output's sum runs over the columns in order into the value y held, so a call continuing
 *   another sums as one call over both.
 * AVX-512 (level 2) and AVX2 (level 1, half the lanes: mm16_tile_avx2, mm16_cols_avx2) run
 * the same operations lane for lane, so the same bits; both fuse each multiply-add (one
 * rounding), the portable loop multiplies then adds (two): equal to ~1e-6 relative, neither
 * BLAS's order (tests/test_kernels.py).
 */
#ifndef MLX_FLASH_GEMM16_H
#define MLX_FLASH_GEMM16_H

#include <stdint.h>

#define MM16_ROWS 8 /* rows a tile: 8 accumulators (each 16 positions of one row) */
#define MM16_RUN 64 /* values a row's sum takes into a register of its own before its total */
#define MM16_PAD 16 /* floats between a dequantized tile's rows beyond their length: rows a power of
                     * two apart share the L1 cache's sets and evict each other */
#define MM16_KBLOCK 64 /* columns a pass of mm16_cols over the outputs (a tile of 64 x the part's outputs) */

/* one row r of a, every position b < m: y[b * ldy] (+)= sum_kk a[kk * ks] * xt[kk * 16 + b], in runs of
 * `run` values (mm16_tile's MM16_RUN; 0: one run over all of k, added to y at the end, where
 * mm16_cols adds into y as it goes: the portable loops round apart from the tiles anyway) */
static void mm16_row_portable(const float *a, int64_t ks, const float *xt, int64_t k, int64_t m, float *y,
                              int64_t ldy, int accumulate, int64_t run) {
    float acc[16] = {0};
    if (run <= 0) run = k;
    for (int64_t k0 = 0; k0 < k; k0 += run) {
        float part[16] = {0};
        for (int64_t kk = k0; kk < k0 + run && kk < k; kk++) {
            const float w = a[kk * ks];
            for (int64_t b = 0; b < m; b++) {
                const float t = w * xt[kk * 16 + b];
                part[b] += t;
            }
        }
        for (int64_t b = 0; b < m; b++) acc[b] += part[b];
    }
    for (int64_t b = 0; b < m; b++) y[b * ldy] = accumulate ? y[b * ldy] + acc[b] : acc[b];
}

#ifdef BF16_PATH /* x86-64 with a compiler that has AVX-512 (avx512.h); simd level 2 */
/* MM16_ROWS rows, lda floats apart from a: out[r * 16 + b] = their sums for all 16 lanes, in runs
 * of MM16_RUN values */
TARGET_AVX512_BF16 static void mm16_tile(const float *a, int64_t lda, const float *xt, int64_t k, float *out) {
    __m512 acc[MM16_ROWS];
    for (int r = 0; r < MM16_ROWS; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < k; k0 += MM16_RUN) {
        const int64_t k1 = k0 + MM16_RUN < k ? k0 + MM16_RUN : k;
        __m512 run[MM16_ROWS];
        for (int r = 0; r < MM16_ROWS; r++) run[r] = _mm512_setzero_ps();
        for (int64_t kk = k0; kk < k1; kk++) {
            const __m512 xv = _mm512_loadu_ps(xt + kk * 16);
            for (int r = 0; r < MM16_ROWS; r++) run[r] = _mm512_fmadd_ps(_mm512_set1_ps(a[r * lda + kk]), xv, run[r]);
        }
        for (int r = 0; r < MM16_ROWS; r++) acc[r] = _mm512_add_ps(acc[r], run[r]);
    }
    for (int r = 0; r < MM16_ROWS; r++) _mm512_storeu_ps(out + r * 16, acc[r]);
}

/* the same 32 values as floats */
TARGET_AVX512_BF16 static inline void unpack4_avx512(const uint8_t *p, __m512 v[2]) {
    __m512i q[2];
    nibbles4_avx512(p, q);
    v[0] = _mm512_cvtepi32_ps(q[0]), v[1] = _mm512_cvtepi32_ps(q[1]);
}

/* 16 scales or biases at code -> floats */
TARGET_AVX512_BF16 static inline __m512 load16_scales(const uint8_t *p, int64_t code) {
    if (code == F32) return _mm512_loadu_ps((const float *)p);
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (code == F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); /* bfloat16 */
}

/* a 4-bit row's k values (groups of g, a multiple of 32): scale * q, then + bias, as
 * dequantize_row_avx2 (a multiply, then an add: the same values to the bit), 32 a step in
 * 512-bit registers (a pass's tiles dequantize every weight: ~2x the AVX2 loop's rate). A group
 * has 16 values only: its table (scale * q + bias for q = 0 .. 15, each a multiply then an add,
 * the same bits) is made once, and each q picks its value from it (a permute in place of a
 * conversion, a multiply and an add) */
TARGET_AVX512_BF16 static void dequantize_row4_avx512(const uint8_t *w, const float *sc, const float *bi, int64_t k,
                                                     int64_t g, float *out) {
    const __m512 q16 = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i q[2];
    for (int64_t k0 = 0; k0 < k; k0 += g) {
        const __m512 table = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(sc[k0 / g]), q16), _mm512_set1_ps(bi[k0 / g]));
        for (int64_t i = k0; i < k0 + g; i += 32) {
            nibbles4_avx512(w + i / 2, q);
            _mm512_storeu_ps(out + i, _mm512_permutexvar_ps(q[0], table));
            _mm512_storeu_ps(out + i + 16, _mm512_permutexvar_ps(q[1], table));
        }
    }
}

/* dequant_cols_avx2 (_matvec.c) for 4-bit columns in 512-bit registers: the same values (a
 * multiply, then an add) in the same places (one column with bs = 16: in order). Consecutive
 * columns of one table row (a group's: a block of a dense layer's 64 neurons all share one; a
 * sparse selection fewer) take its 32 scales and biases loaded and converted once
 * (qmm_cols 1.0-1.17x faster at this level) */
TARGET_AVX512_BF16 static void dequant_cols4_tile(const uint8_t *const *p, const uint8_t *const *sr,
                                                 const uint8_t *const *br, int64_t nr, int64_t n, int64_t code,
                                                 float *out, int64_t bs) {
    const int64_t ssz = code == F32 ? 4 : 2;
    __m512 v[2], s[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}, b[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t c = 0; c < n; c += 32) {
        const uint8_t *held_s = NULL, *held_b = NULL;
        for (int64_t i = 0; i < nr; i++) {
            if (sr[i] != held_s || br[i] != held_b) {
                held_s = sr[i], held_b = br[i];
                for (int l = 0; l < 2; l++) {
                    s[l] = load16_scales(held_s + (c + 16 * l) * ssz, code);
                    b[l] = load16_scales(held_b + (c + 16 * l) * ssz, code);
                }
            }
            unpack4_avx512(p[i] + c / 2, v);
            for (int l = 0; l < 2; l++) {
                const int64_t at = c + 16 * l;
                _mm512_storeu_ps(out + at / 16 * bs + i * 16, _mm512_add_ps(_mm512_mul_ps(s[l], v[l]), b[l]));
            }
        }
    }
}


/* W [k, n] as qmm_cols's tile holds it (element (kk, r) at a[(r / 16) * bs + kk * 16 + r % 16]),
 * outputs [0, n): 16 outputs a register, each position's sums its own register (a broadcast of
 * x[b, kk] times 16 weights of row kk), added to y where `add` */
TARGET_AVX512_BF16 static void mm16_cols(const float *a, int64_t bs, const float *xt, int64_t k, int64_t m,
                                         float *y, int64_t ldy, int add, int64_t n) {
    for (int64_t r = 0; r < n; r += 16) {
        const __mmask16 lanes = n - r >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - r)) - 1);
        const float *ar = a + r / 16 * bs;
        __m512 acc[16];
        if (m == 16) { /* (the registers indexed by constants only: indexed by m, the compiler
                        * keeps them in memory; fewer positions go through a local copy) */
            for (int b = 0; b < 16; b++) acc[b] = add ? _mm512_maskz_loadu_ps(lanes, y + b * ldy + r) : _mm512_setzero_ps();
        } else {
            float io[16][16];
            for (int64_t b = 0; b < 16; b++)
                _mm512_storeu_ps(io[b], add && b < m ? _mm512_maskz_loadu_ps(lanes, y + b * ldy + r) : _mm512_setzero_ps());
            for (int b = 0; b < 16; b++) acc[b] = _mm512_loadu_ps(io[b]);
        }
        for (int64_t kk = 0; kk < k; kk++) {
            const __m512 wv = _mm512_loadu_ps(ar + kk * 16);
            const float *xk = xt + kk * 16;
            for (int b = 0; b < 16; b++) acc[b] = _mm512_fmadd_ps(_mm512_set1_ps(xk[b]), wv, acc[b]);
        }
        if (m == 16) {
            for (int b = 0; b < 16; b++) _mm512_mask_storeu_ps(y + b * ldy + r, lanes, acc[b]);
        } else {
            float io[16][16];
            for (int b = 0; b < 16; b++) _mm512_storeu_ps(io[b], acc[b]);
            for (int64_t b = 0; b < m; b++) _mm512_mask_storeu_ps(y + b * ldy + r, lanes, _mm512_loadu_ps(io[b]));
        }
    }
}
#endif

#ifdef AVX2_PATH /* x86-64 (_matvec.c): simd level 1 */
/* mm16_tile at 256 bits (AVX2 + FMA): 4 rows at a time, two registers a row (positions 0-7 and
 * 8-15); each run of MM16_RUN values summed in registers from zero, then added to the row's
 * total in `out`: lane for lane mm16_tile's operations, so the same bits */
AVX2 static void mm16_tile_avx2(const float *a, int64_t lda, const float *xt, int64_t k, float *out) {
    for (int i = 0; i < MM16_ROWS * 16; i++) out[i] = 0.0f;
    for (int r0 = 0; r0 < MM16_ROWS; r0 += 4)
        for (int64_t k0 = 0; k0 < k; k0 += MM16_RUN) {
            const int64_t k1 = k0 + MM16_RUN < k ? k0 + MM16_RUN : k;
            __m256 lo[4], hi[4];
            for (int r = 0; r < 4; r++) lo[r] = hi[r] = _mm256_setzero_ps();
            for (int64_t kk = k0; kk < k1; kk++) {
                const __m256 x0 = _mm256_loadu_ps(xt + kk * 16), x1 = _mm256_loadu_ps(xt + kk * 16 + 8);
                for (int r = 0; r < 4; r++) {
                    const __m256 w = _mm256_broadcast_ss(a + (r0 + r) * lda + kk);
                    lo[r] = _mm256_fmadd_ps(w, x0, lo[r]);
                    hi[r] = _mm256_fmadd_ps(w, x1, hi[r]);
                }
            }
            for (int r = 0; r < 4; r++) {
                float *o = out + (r0 + r) * 16;
                _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), lo[r]));
                _mm256_storeu_ps(o + 8, _mm256_add_ps(_mm256_loadu_ps(o + 8), hi[r]));
            }
        }
}

/* mm16_cols at 256 bits: 8 outputs a register (n a multiple of 8), 8 positions a pass over the
 * tile; each output's sum over the columns in order into the value y held: lane for lane
 * mm16_cols's operations */
AVX2 static void mm16_cols_avx2(const float *a, int64_t bs, const float *xt, int64_t k, int64_t m, float *y,
                                int64_t ldy, int add, int64_t n) {
    for (int64_t r = 0; r < n; r += 8) {
        const float *ar = a + r / 16 * bs + r % 16;
        for (int64_t b0 = 0; b0 < m; b0 += 8) {
            /* (through a local copy: registers indexed by constants only) */
            float io[8][8];
            for (int64_t b = 0; b < 8; b++)
                _mm256_storeu_ps(io[b], add && b0 + b < m ? _mm256_loadu_ps(y + (b0 + b) * ldy + r) : _mm256_setzero_ps());
            __m256 acc[8];
            for (int b = 0; b < 8; b++) acc[b] = _mm256_loadu_ps(io[b]);
            for (int64_t kk = 0; kk < k; kk++) {
                const __m256 wv = _mm256_loadu_ps(ar + kk * 16);
                const float *xk = xt + kk * 16 + b0;
                for (int b = 0; b < 8; b++) acc[b] = _mm256_fmadd_ps(_mm256_broadcast_ss(xk + b), wv, acc[b]);
            }
            for (int b = 0; b < 8; b++) _mm256_storeu_ps(io[b], acc[b]);
            for (int64_t b = 0; b < 8 && b0 + b < m; b++) _mm256_storeu_ps(y + (b0 + b) * ldy + r, _mm256_loadu_ps(io[b]));
        }
    }
}
#endif

#endif
