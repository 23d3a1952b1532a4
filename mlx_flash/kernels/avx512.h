/* The 4-bit matrix-vector product on x86-64 CPUs with AVX-512 (the kernels' SIMD level 2:
 * AVX-512 F, BW and BF16, as on AMD Zen 4 and later, Intel Cooper Lake / Sapphire Rapids and
 * later), and the definitions the level's other loops share (gemm16.h), included by _matvec.c.
 *
 * A 4-bit row on the AVX2 loop (row4_avx2) widens, masks and converts each value before its
 * multiply-add, 8 at a time. Here 16 go at a time: per 32 values (16 bytes; byte i holds value
 * 2i in its low nibble and 2i + 1 in its high one) one widening load of the 16 bytes into 16
 * int32 lanes, a mask (the 16 even-indexed values) and a shift (the 16 odd-indexed), two
 * conversions and two multiply-adds against x prepared in that order once per call
 * (order_x_avx512: per 32 values the 16 even-indexed, then the 16 odd). A row's scales are
 * converted to float32 first (16 at a time), not one by one in the loop. Every product and sum
 * is float32, as on the AVX2 loop; only the order of the sums differs (tests/test_kernels.py
 * holds every level to MLX's quantized_matmul).
 *
 * One row of 1536 values in the L2 cache takes ~65 ns on one Zen 5 core here (23 G values/s,
 * against 18 for the earlier loop over x split into three bfloat16 parts and 14 for the AVX2
 * loop): what remains is the memory's rate, which _matvec.c's run_rows meets by prefetching
 * the rows two ahead.
 *
 * Built with GCC 11 or later, or a clang that has the BF16 builtins; otherwise (and off
 * x86-64) this file defines nothing and 4-bit rows stay on AVX2.
 */
#ifndef MLX_FLASH_AVX512_H
#define MLX_FLASH_AVX512_H

#include <stdint.h>

#if defined(__clang__) && defined(__has_builtin)
#if __has_builtin(__builtin_ia32_dpbf16ps_512)
#define BF16_COMPILER 1
#endif
#elif defined(__GNUC__) && __GNUC__ >= 11
#define BF16_COMPILER 1
#endif

#if defined(__x86_64__) && defined(BF16_COMPILER)
#include <immintrin.h>
#define BF16_PATH 1
#define TARGET_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16,avx2,fma,f16c")))

static int cpu_bf16(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512bf16");
}

/* x [k] (k % 64 == 0) -> xe [k]: per 32 values the 16 even-indexed, then the 16 odd-indexed */
TARGET_AVX512_BF16 static void order_x_avx512(const float *x, int64_t k, float *xe) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int64_t c = 0; c < k; c += 32) {
        const __m512 a = _mm512_loadu_ps(x + c), b = _mm512_loadu_ps(x + c + 16);
        _mm512_storeu_ps(xe + c, _mm512_permutex2var_ps(a, even, b));
        _mm512_storeu_ps(xe + c + 16, _mm512_permutex2var_ps(a, odd, b));
    }
}

/* one 4-bit row . x (k % 64 == 0, g a multiple of 32): sum over groups of scale(group) * (q . x);
 * sc: the row's k / g scales as float32. Two groups' halves a step, in two accumulators. */
TARGET_AVX512_BF16 static float row4_avx512(const uint8_t *w, const float *sc, const float *xe, int64_t k, int64_t g) {
    const __m512i m15 = _mm512_set1_epi32(15);
    const int shift = __builtin_ctzll((unsigned long long)g); /* g is 32, 64 or 128 */
    __m512 t0 = _mm512_setzero_ps(), t1 = t0;
    for (int64_t i = 0; i < k; i += 64) {
        const __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + i / 2)));
        const __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + i / 2 + 16)));
        __m512 a0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v0, m15)), _mm512_loadu_ps(xe + i));
        __m512 a1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v1, m15)), _mm512_loadu_ps(xe + i + 32));
        a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v0, 4)), _mm512_loadu_ps(xe + i + 16), a0);
        a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v1, 4)), _mm512_loadu_ps(xe + i + 48), a1);
        t0 = _mm512_fmadd_ps(_mm512_set1_ps(sc[i >> shift]), a0, t0);
        t1 = _mm512_fmadd_ps(_mm512_set1_ps(sc[(i + 32) >> shift]), a1, t1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(t0, t1));
}

/* 32 4-bit values (16 bytes: byte i holds value 2i low, 2i + 1 high) -> 2 x 16 int32 in order */
TARGET_AVX512_BF16 static inline void nibbles4_avx512(const uint8_t *p, __m512i q[2]) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p), m = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
    q[0] = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)); /* values 0-15 */
    q[1] = _mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)); /* 16-31 */
}

/* qaxpy_cols's step over a few columns at once (m <= 4; p[r] their packed values at 4 or 8 bits,
 * h[r] their weights; n a multiple of 32): acc[c] += h[0] * q_0[c], then += h[1] * q_1[c], ...
 * each a multiply, then an add, in the columns' order: the AVX2 and portable loops' operations,
 * so their sums to the bit. 4 bits: h * q for the 16 values q may take is a table made once a
 * call, and each q picks its product from it (a permute in place of a conversion and a multiply) */
TARGET_AVX512_BF16 static void axpy_cols_avx512(const uint8_t *const *p, const float *h, int m, int64_t bits,
                                                int64_t n, float *acc) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 hv[4];
    for (int r = 0; r < m; r++) hv[r] = bits == 4 ? _mm512_mul_ps(_mm512_set1_ps(h[r]), iota) : _mm512_set1_ps(h[r]);
    for (int64_t c = 0; c < n; c += 32) {
        __m512 a0 = _mm512_loadu_ps(acc + c), a1 = _mm512_loadu_ps(acc + c + 16);
        for (int r = 0; r < m; r++) {
            if (bits == 4) {
                __m512i q[2];
                nibbles4_avx512(p[r] + c / 2, q);
                a0 = _mm512_add_ps(a0, _mm512_permutexvar_ps(q[0], hv[r]));
                a1 = _mm512_add_ps(a1, _mm512_permutexvar_ps(q[1], hv[r]));
            } else {
                const __m512 v0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p[r] + c))));
                const __m512 v1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p[r] + c + 16))));
                a0 = _mm512_add_ps(a0, _mm512_mul_ps(hv[r], v0));
                a1 = _mm512_add_ps(a1, _mm512_mul_ps(hv[r], v1));
            }
        }
        _mm512_storeu_ps(acc + c, a0);
        _mm512_storeu_ps(acc + c + 16, a1);
    }
}
#endif

#endif
