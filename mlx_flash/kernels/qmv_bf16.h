/* The 4-bit matrix-vector product on x86-64 CPUs with AVX-512 BF16 (AMD Zen 4 and later,
 * Intel Cooper Lake / Sapphire Rapids and later), included by _matvec.c.
 *
 * Why: the AVX2 loop (row4_avx2) turns every 4-bit value into a float32 (widen, mask,
 * convert) before its multiply-add; a decode of a 4-bit mixture of experts spends most of
 * its time there, compute-bound at ~13 GMAC/s on two Zen 4 cores, while llama.cpp multiplies
 * 4-bit weights by int8-quantized activations. Quantizing x would break the exact parity we
 * keep with MLX. Instead x is split, once per call, into three bfloat16 parts whose sum is x
 * exactly (8 + 8 + 8 significant bits: float32's 24), and the 4-bit values, exact in
 * bfloat16, are looked up from a 32-entry table (one vpermw per 32 values). VDPBF16PS then
 * multiplies 32 pairs a step, every product exact in float32 and summed in float32 as the
 * AVX2 loop sums: the same y to ~1e-6 relative, not to the bit (tests/test_kernels.py holds
 * every path to 1e-5 of MLX's quantized_matmul).
 *
 * Layout, per 64 values c .. c + 63 of a row (32 bytes; byte i holds value 2i in its low
 * nibble, 2i + 1 in its high one): the low nibbles are the row's even-indexed values, the
 * high ones its odd-indexed; x's parts are stored the same way, per 64 values the 32
 * even-indexed then the 32 odd-indexed, part after part (xb[part * k + ...]). A float32 lane
 * of VDPBF16PS sums two neighbouring words: lanes 0-7 cover values c .. c + 31, lanes 8-15
 * values c + 32 .. c + 63, so each half takes its own group's scale (g is a multiple of 32).
 * Rows whose k is not a multiple of 64 stay on the AVX2 loop.
 *
 * Exact for every x a model produces; outside that: |x| below ~2^-110 loses its low parts
 * (bfloat16 subnormals, which VDPBF16PS reads as zero), and finite |x| above ~3.39e38 rounds
 * to infinity (a NaN row where the AVX2 loop stays finite).
 *
 * Built with GCC 11 or later, or a clang that has the instruction's builtin; otherwise (and
 * off x86-64) this file defines nothing and 4-bit rows stay on AVX2.
 */
#ifndef MLX_FLASH_QMV_BF16_H
#define MLX_FLASH_QMV_BF16_H

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

/* 16 floats -> their bfloat16 rounding to nearest even (as 16-bit words in 32-bit lanes), and
 * those back as floats. Finite x only (activations); the residual x - back is exact. */
TARGET_AVX512_BF16 static inline __m512i bf16_round(__m512 x, __m512 *back) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    *back = _mm512_castsi512_ps(_mm512_slli_epi32(r, 16));
    return r;
}

/* x [k] (k % 64 == 0) -> xb [3 * k] bfloat16 words: x = part 0 + part 1 + part 2 exactly,
 * per 64 values the 32 even-indexed then the 32 odd-indexed */
TARGET_AVX512_BF16 static void split_x_bf16(const float *x, int64_t k, uint16_t *xb) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int64_t c = 0; c < k; c += 64) {
        const __m512 a = _mm512_loadu_ps(x + c), b = _mm512_loadu_ps(x + c + 16);
        const __m512 d = _mm512_loadu_ps(x + c + 32), e = _mm512_loadu_ps(x + c + 48);
        /* the 32 even-indexed values (x[c], x[c+2], ..), then the 32 odd-indexed */
        __m512 v[4] = {_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(d, even, e),
                       _mm512_permutex2var_ps(a, odd, b), _mm512_permutex2var_ps(d, odd, e)};
        for (int part = 0; part < 3; part++)
            for (int h = 0; h < 4; h++) {
                __m512 back;
                const __m512i r = bf16_round(v[h], &back);
                _mm256_storeu_si256((__m256i *)(xb + part * k + c + 16 * h), _mm512_cvtepi32_epi16(r));
                v[h] = _mm512_sub_ps(v[h], back);
            }
    }
}

/* scale i of a row's scales at code (float32, float16 or bfloat16), exactly: the value
 * values_f32 gives (its hardware and software float16 conversions agree on every input) */
TARGET_AVX512_BF16 static inline float scale_at(const uint8_t *p, int64_t i, int64_t code) {
    if (code == F32) {
        float f;
        memcpy(&f, p + 4 * i, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, p + 2 * i, 2);
    return code == F16 ? _cvtsh_ss(h) : f32_from_bits((uint32_t)h << 16);
}

/* one 4-bit row . x: sum over 64-value steps of scale(group) * (q . x), in float32 lanes; the
 * row's scales read where they lie (sp at scode), not converted into a scratch row first: that
 * conversion, a call a row, took a fifth of this loop's time (stop 49) */
TARGET_AVX512_BF16 static float row4_bf16(const uint8_t *w, const uint8_t *sp, int64_t scode, const uint16_t *xb,
                                          int64_t k, int64_t g) {
    /* word i -> bfloat16 of (i & 15): vpermw reads an index's low 5 bits, so a byte's high
     * nibble's low bit does not disturb its low nibble's lookup */
    static const uint16_t table[32] = {0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
                                       0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
                                       0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
                                       0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
    const __m512i lut = _mm512_loadu_si512(table);
    const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512 zero = _mm512_setzero_ps();
    __m512 tot0 = zero, tot1 = zero;
    for (int64_t c = 0; c < k; c += 64) {
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(w + c / 2)));
        const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(v, lut);
        const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), lut);
        const uint16_t *x = xb + c;
#define XPART(p, o) ((__m512bh)_mm512_loadu_si512(x + (p) * k + (o)))
        __m512 a0 = _mm512_dpbf16_ps(zero, lo, XPART(0, 0));
        __m512 a1 = _mm512_dpbf16_ps(zero, lo, XPART(1, 0));
        __m512 a2 = _mm512_dpbf16_ps(zero, lo, XPART(2, 0));
        a0 = _mm512_dpbf16_ps(a0, hi, XPART(0, 32));
        a1 = _mm512_dpbf16_ps(a1, hi, XPART(1, 32));
        a2 = _mm512_dpbf16_ps(a2, hi, XPART(2, 32));
#undef XPART
        const __m512 a = _mm512_add_ps(a0, _mm512_add_ps(a1, a2));
        const __m128 s2 = _mm_setr_ps(scale_at(sp, c / g, scode), scale_at(sp, (c + 32) / g, scode), 0, 0);
        const __m512 s = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(s2));
        if ((c / 64) & 1)
            tot1 = _mm512_fmadd_ps(s, a, tot1);
        else
            tot0 = _mm512_fmadd_ps(s, a, tot0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(tot0, tot1));
}
#endif

#endif
