/* 4- and 8-bit matrix-vector products in integers on x86-64 CPUs with AVX-512 VNNI (the kernels'
 * SIMD level 3: level 2's AVX-512 F, BW and BF16, and VNNI, as on Intel Sapphire Rapids and later,
 * AMD Zen 4 and later), included by _matvec.c after avx512.h.
 *
 * The float32 loops (row4_avx512, row8_avx2) widen every packed value to a float32 lane before its
 * multiply-add: 32 vector operations per 128 4-bit values, and a core ran them at ~8 G values/s,
 * below what two cores need to keep up with the memory. Here the packed bytes meet x in
 * integers: vpdpbusd multiplies 64 unsigned bytes (the values q, 0..15 or 0..255) by 64 signed
 * bytes and sums each 4 adjacent products into an int32 lane, exactly. x is written as signed
 * bytes once per call (prepare_vnni), shared by every row: each int32 lane's values (8 at 4 bits,
 * 4 at 8 bits) get a unit s of their own, a power of two, and three digits each:
 *
 *     x = s * N + r,  N = round(x / s) = d0 * 2^16 + d1 * 2^8 + d2,  -128 <= d0, d1, d2 <= 127
 *
 * with s = 2^(f - 22) where 2^f <= max|x| < 2^(f + 1) over the lane's values (2^(f - 21) where
 * the largest would round N to d0 = 128): x / s and the rounding are exact, |r| <= s / 2 <=
 * 2^-23 max|x|, float32's own rounding of the lane's largest value. Each d is N's byte in
 * balanced base 256. A row's sums q . N are exact in int32; what follows is float32 as on the
 * other loops: per lane s * (q . N) (a power of two: exact), times the group's scale, summed in
 * 16 lanes; the biases as on every level, bias . x's group sums. So the result is the float32
 * loops' to their rounding, outliers and all (tests/test_kernels.py holds every level to float64
 * references and MLX's quantized_matmul), unlike llama.cpp's 8-bit x (2^-8 of a block's largest).
 *
 * Before the digits x is multiplied by 2^-E (E: max|x|'s exponent), and a row's sum by 2^E after:
 * the units then lie between 2^-122 and 2^-20 and stay normal for any x (1e-30, subnormals or
 * 1e30 alike); values 2^100 below x's largest count as 0 (below float32's rounding of any sum
 * that holds the largest). An x that holds an infinity or a NaN makes every sum NaN.
 *
 * Layout (xd, 64-byte aligned), in chunks of the 64 bytes a row's register holds:
 *   4 bits, 128 values a chunk (byte b holds value 2b low, 2b + 1 high): 448 bytes, the 16 float32
 *     units of its int32 lanes (lane l sums bytes 4l .. 4l + 3: values 8l .. 8l + 7), then per
 *     digit the 64 even-indexed values' and the 64 odd-indexed' (a row's low nibbles meet the
 *     first, its high nibbles the second);
 *   8 bits, 64 values a chunk: 256 bytes, the 16 units (lane l: values 4l .. 4l + 3), then per
 *     digit the 64 values in order.
 * A row's chunk: 6 (4 bits) or 3 (8 bits) vpdpbusd, the digits' sums combined in int32 by shifts
 * (at 8 bits d0's and d1's only: with d2's they could pass 2^31), converted, times the units and
 * the group's scales (picked per lane from the row's by a permute), summed: 17 vector operations
 * per 128 4-bit values. One row of 1536 values in the L2 cache took 60-90 ns at 4 bits (110-140
 * on row4_avx512) and 80-85 at 8 bits (200-210 on row8_avx2) on one core of a Xeon (Emerald
 * Rapids) virtual machine here; the vector ports are what bounds it (vpdpbusd runs 2 a cycle
 * there).
 *
 * Built with a compiler that has avx512.h's AVX-512 part and VNNI (GCC 8 or later, a clang with
 * vpdpbusd's builtin); otherwise (and off x86-64) this file defines nothing and rows stay on the
 * level 2 loops.
 */
#ifndef MLX_FLASH_VNNI_H
#define MLX_FLASH_VNNI_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__clang__) && defined(__has_builtin)
#if __has_builtin(__builtin_ia32_vpdpbusd512)
#define VNNI_COMPILER 1
#endif
#elif defined(__GNUC__) && __GNUC__ >= 8
#define VNNI_COMPILER 1
#endif

#if defined(BF16_PATH) && defined(VNNI_COMPILER)
#define VNNI_PATH 1
#define TARGET_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma")))

static int cpu_vnni(void) { return cpu_bf16() && __builtin_cpu_supports("avx512vnni"); }

/* bytes of the digits of k values (k % 64 == 0) for rows at bits (4 or 8) */
static int64_t vnni_bytes(int64_t k, int64_t bits) { return bits == 4 ? (k + 127) / 128 * 448 : k / 64 * 256; }

/* 16 values v (x times 2^-E) times c (1 / their units: powers of two) -> N, rounded to the nearest
 * (ties to even), and N's digits d0, d1, d2 as 16 bytes each at out, out + apart, out + 2 apart.
 * N + 0x8080 holds them in its bytes: byte 2 is d0, byte 1 d1 + 128, byte 0 d2 + 128 (N = 2^16 d0 +
 * 2^8 d1 + d2 with d1, d2 in -128 .. 127 makes N + 0x8080 = 2^16 d0 + 2^8 (d1 + 128) + (d2 + 128),
 * each byte in range), gathered by a byte shuffle within each 128 bits, then a dword permute
 * across them */
TARGET_VNNI static inline void digits_vnni(__m512 v, __m512 c, uint8_t *out, int64_t apart) {
    const __m512i bytes = _mm512_set4_epi32(-1, 0x0c080400, 0x0d090501, 0x0e0a0602); /* per 4 lanes: bytes 2, 1, 0 */
    const __m512i lanes = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512i flip = _mm512_setr_epi32(0, 0, 0, 0, -0x7f7f7f80, -0x7f7f7f80, -0x7f7f7f80, -0x7f7f7f80, -0x7f7f7f80,
                                           -0x7f7f7f80, -0x7f7f7f80, -0x7f7f7f80, 0, 0, 0, 0); /* 0x80808080 */
    const __m512i n = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v, c), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i b = _mm512_shuffle_epi8(_mm512_add_epi32(n, _mm512_set1_epi32(0x8080)), bytes);
    const __m512i d = _mm512_xor_si512(_mm512_permutexvar_epi32(lanes, b), flip); /* d0 | d1 | d2 | - */
    _mm_storeu_si128((__m128i *)out, _mm512_castsi512_si128(d));
    _mm_storeu_si128((__m128i *)(out + apart), _mm512_extracti32x4_epi32(d, 1));
    _mm_storeu_si128((__m128i *)(out + 2 * apart), _mm512_extracti32x4_epi32(d, 2));
}

/* 2^n as a float32 (n in -126 .. 127) */
static inline float pow2_vnni(int n) {
    const uint32_t u = (uint32_t)(n + 127) << 23;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* 4 vectors' largest value within each 128 bits: lane 4b + i of the result is vector i's bits b's */
TARGET_VNNI static inline __m512 max4x4_vnni(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_max_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)); /* a02 b02 a13 b13 */
    const __m512 cd = _mm512_max_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    return _mm512_max_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xee));
}

/* x [k] (k % 64 == 0) -> xd (vnni_bytes(k, bits), 64-byte aligned) in the layout above -> 2^E,
 * what a row's sum over xd is multiplied by. A chunk a step: the largest |value| of each lane's
 * values in one register, in the lanes' order, and their units from its exponents */
TARGET_VNNI static float prepare_vnni(const float *x, int64_t k, int64_t bits, uint8_t *xd) {
    const __m512 inf = _mm512_set1_ps(INFINITY), one = _mm512_set1_ps(1.0f);
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    const __m512i across = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512i fours = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const int64_t chunk = bits == 4 ? 128 : 64, bytes = bits == 4 ? 448 : 256, nv = chunk / 16;
    __m512 top = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (int64_t i = 0; i < k; i += 16) {
        const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + i));
        top = _mm512_max_ps(top, a);
        bad |= _mm512_cmp_ps_mask(a, inf, _CMP_NLT_UQ); /* an infinity or a NaN */
    }
    if (bad) { /* every unit NaN, every digit 0 */
        memset(xd, 0, (size_t)vnni_bytes(k, bits));
        for (int64_t c = 0; c < vnni_bytes(k, bits); c += bytes) _mm512_store_ps(xd + c, _mm512_set1_ps(NAN));
        return 1.0f;
    }
    /* max|x| in [1, 2) after 2^-E (E: its exponent field's; 2^-E and 2^E kept normal) */
    const float largest = _mm512_reduce_max_ps(top);
    uint32_t bits_of;
    memcpy(&bits_of, &largest, 4);
    const int e0 = (int)(bits_of >> 23) - 127, e = e0 < -126 ? -126 : e0 > 126 ? 126 : e0;
    const __m512 down = _mm512_set1_ps(pow2_vnni(-e));
    if (k % chunk) memset(xd + k / chunk * bytes, 0, (size_t)bytes); /* a 4-bit row's last half chunk */
    for (int64_t i = 0; i < k; i += chunk) {
        const int64_t have = (k - i) / 16 < nv ? (k - i) / 16 : nv; /* 16 values each */
        __m512 v[8], a[8];
        for (int j = 0; j < nv; j++) {
            v[j] = j < have ? _mm512_mul_ps(_mm512_loadu_ps(x + i + 16 * j), down) : _mm512_setzero_ps();
            a[j] = _mm512_abs_ps(v[j]);
        }
        if (bits == 4) /* lane l: values 8l .. 8l + 7, vector l / 2's bits 2 (l % 2) and 2 (l % 2) + 1 */
            for (int j = 0; j < 4; j++)
                a[j] = _mm512_max_ps(_mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0x88),
                                     _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0xdd));
        /* (8 bits, lane l: values 4l .. 4l + 3, vector l / 4's bits l % 4) */
        const __m512 mx = _mm512_permutexvar_ps(across, max4x4_vnni(a[0], a[1], a[2], a[3]));
        /* each lane's unit s = 2^(f - 22), 2^f <= max < 2^(f + 1), and 1 / s; f + 1 where max's
         * mantissa is 2 - 2^-7 - 2^-15 - 2^-23 or more: N would round to 2^23 - 32768 - 128 or
         * past it, d0 128. 0 where max < 2^-100 (zeros, or values 2^100 below x's largest: the
         * digits 0) */
        const __mmask16 some = _mm512_cmp_ps_mask(mx, _mm512_set1_ps(0x1p-100f), _CMP_GE_OQ);
        const __mmask16 up = _mm512_cmp_ps_mask(_mm512_getmant_ps(mx, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_zero),
                                                _mm512_set1_ps(0x1.fdfdfep0f), _CMP_GE_OQ);
        const __m512 f = _mm512_mask_add_ps(_mm512_getexp_ps(mx), up, _mm512_getexp_ps(mx), one);
        const __m512 cs = _mm512_maskz_scalef_ps(some, one, _mm512_sub_ps(_mm512_set1_ps(22.0f), f));
        uint8_t *blk = xd + i / chunk * bytes;
        _mm512_store_ps(blk, _mm512_maskz_scalef_ps(some, one, _mm512_sub_ps(f, _mm512_set1_ps(22.0f))));
        for (int q = 0; q < 4; q++) { /* the lanes 4q .. 4q + 3's values, by their c */
            const __m512 c = _mm512_permutexvar_ps(_mm512_add_epi32(fours, _mm512_set1_epi32(4 * q)), cs);
            if (bits == 4 && 2 * q < have) { /* even-indexed values' digits at 64 + 128p, odd-indexed' 64 bytes on */
                digits_vnni(_mm512_permutex2var_ps(v[2 * q], even, v[2 * q + 1]), c, blk + 64 + 16 * q, 128);
                digits_vnni(_mm512_permutex2var_ps(v[2 * q], odd, v[2 * q + 1]), c, blk + 128 + 16 * q, 128);
            } else if (bits == 8) { /* at 64 + 64p */
                digits_vnni(v[q], c, blk + 64 + 16 * q, 64);
            }
        }
    }
    return pow2_vnni(e);
}

/* lane l's group scale: scale idx[l] of the ones from sc on (m: those that exist) */
TARGET_VNNI static inline __m512 lane_scales_vnni(const float *sc, __mmask16 m, __m512i idx) {
    return _mm512_permutexvar_ps(idx, _mm512_maskz_loadu_ps(m, sc));
}

/* 16 of a row's scales or biases from p (float32, float16 or bfloat16 at code; m: those that exist) */
TARGET_VNNI static inline __m512 load_scales_vnni(const uint8_t *p, int64_t code, __mmask16 m) {
    if (code == F32) return _mm512_maskz_loadu_ps(m, p);
    const __m256i h = _mm512_castsi512_si256(_mm512_maskz_loadu_epi16((__mmask32)m, p));
    return code == F16 ? _mm512_cvtph_ps(h) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* a row's ng scales where they lie (sp) -> sc as float32; -> its biases (bp) times xs (x's group
 * sums times 2^-E), in 16 lanes */
TARGET_VNNI static inline __m512 scales_vnni(const uint8_t *sp, const uint8_t *bp, int64_t code, const float *xs, int64_t ng,
                                             float *sc) {
    const int64_t sz = code == F32 ? 4 : 2;
    __m512 t = _mm512_setzero_ps();
    for (int64_t i = 0; i < ng; i += 16) {
        const __mmask16 m = (__mmask16)(ng - i >= 16 ? 0xffff : (1u << (ng - i)) - 1);
        _mm512_mask_storeu_ps(sc + i, m, load_scales_vnni(sp + sz * i, code, m));
        t = _mm512_fmadd_ps(load_scales_vnni(bp + sz * i, code, m), _mm512_maskz_loadu_ps(m, xs + i), t);
    }
    return t;
}

/* one 4-bit chunk (v: 64 bytes, 128 values) . its x digits, times units and scales, into t */
TARGET_VNNI static inline __m512 chunk4_vnni(__m512i v, const uint8_t *blk, __m512 scales, __m512 t) {
    const __m512i m15 = _mm512_set1_epi8(15), z = _mm512_setzero_si512();
    const __m512i lo = _mm512_and_si512(v, m15), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m15);
    const __m512i *d = (const __m512i *)(blk + 64);
    const __m512i a0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, lo, _mm512_load_si512(d)), hi, _mm512_load_si512(d + 1));
    const __m512i a1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, lo, _mm512_load_si512(d + 2)), hi, _mm512_load_si512(d + 3));
    const __m512i a2 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, lo, _mm512_load_si512(d + 4)), hi, _mm512_load_si512(d + 5));
    /* (|a_p| <= 8 * 15 * 128: the whole below 2^30) */
    const __m512i a = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(_mm512_slli_epi32(a0, 8), a1), 8), a2);
    const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(a), _mm512_load_ps((const float *)blk));
    return _mm512_fmadd_ps(f, scales, t);
}

/* a 4-bit row's sums over x's digits (k % 64 == 0; g 32, 64 or 128; sc the row's k / g scales as
 * float32; xd prepare_vnni's) added to t, in 16 lanes */
TARGET_VNNI static __m512 row4_vnni(const uint8_t *w, const float *sc, const uint8_t *xd, int64_t k, int64_t g, __m512 t0) {
    const int shift = __builtin_ctzll((unsigned long long)g);
    const __m512i idx = _mm512_srlv_epi32(_mm512_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120),
                                          _mm512_set1_epi32(shift)); /* lane l: values 8l .. */
    const __mmask16 m = (__mmask16)((1u << (128 >> shift)) - 1);
    const int64_t whole = k / 128;
    __m512 t1 = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 2 <= whole; c += 2) {
        t0 = chunk4_vnni(_mm512_loadu_si512(w + 64 * c), xd + 448 * c, lane_scales_vnni(sc + (128 * c >> shift), m, idx), t0);
        t1 = chunk4_vnni(_mm512_loadu_si512(w + 64 * c + 64), xd + 448 * c + 448,
                         lane_scales_vnni(sc + ((128 * c + 128) >> shift), m, idx), t1);
    }
    if (c < whole) {
        t0 = chunk4_vnni(_mm512_loadu_si512(w + 64 * c), xd + 448 * c, lane_scales_vnni(sc + (128 * c >> shift), m, idx), t0);
        c++;
    }
    if (k % 128) { /* 64 values: 32 bytes */
        const __mmask16 mh = (__mmask16)((1u << (64 >> shift)) - 1);
        t1 = chunk4_vnni(_mm512_maskz_loadu_epi8(0xffffffffull, w + 64 * c), xd + 448 * c,
                         lane_scales_vnni(sc + (128 * c >> shift), mh, idx), t1);
    }
    return _mm512_add_ps(t0, t1);
}

/* three digits' int32 sums a0, a1, a2 -> (a0 * 2^8 + a1) * 2^8 + a2 as float32: d0's and d1's in
 * one int32 (with |a0| below 2^23 it cannot overflow), converted, then d2's added in one rounding */
TARGET_VNNI static inline __m512 digit_sums_vnni(__m512i a0, __m512i a1, __m512i a2) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(a0, 8), a1)), _mm512_set1_ps(256.0f),
                           _mm512_cvtepi32_ps(a2));
}

/* one 8-bit chunk (64 values) as chunk4_vnni: its digits' sums combined by digit_sums_vnni
 * (|a0| <= 4 * 255 * 128) */
TARGET_VNNI static inline __m512 chunk8_vnni(__m512i v, const uint8_t *blk, __m512 scales, __m512 t) {
    const __m512i z = _mm512_setzero_si512();
    const __m512i *d = (const __m512i *)(blk + 64);
    const __m512i a0 = _mm512_dpbusd_epi32(z, v, _mm512_load_si512(d)), a1 = _mm512_dpbusd_epi32(z, v, _mm512_load_si512(d + 1));
    const __m512i a2 = _mm512_dpbusd_epi32(z, v, _mm512_load_si512(d + 2));
    return _mm512_fmadd_ps(_mm512_mul_ps(digit_sums_vnni(a0, a1, a2), _mm512_load_ps((const float *)blk)), scales, t);
}

/* an 8-bit row's sums, as row4_vnni: 64 values a chunk */
TARGET_VNNI static __m512 row8_vnni(const uint8_t *w, const float *sc, const uint8_t *xd, int64_t k, int64_t g, __m512 t0) {
    const int shift = __builtin_ctzll((unsigned long long)g);
    const __m512i idx = _mm512_srlv_epi32(_mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60),
                                          _mm512_set1_epi32(shift)); /* lane l: values 4l .. */
    const __mmask16 m = (__mmask16)(shift == 5 ? 3 : 1);
    const int64_t n = k / 64;
    __m512 t1 = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 2 <= n; c += 2) {
        t0 = chunk8_vnni(_mm512_loadu_si512(w + 64 * c), xd + 256 * c, lane_scales_vnni(sc + (64 * c >> shift), m, idx), t0);
        t1 = chunk8_vnni(_mm512_loadu_si512(w + 64 * c + 64), xd + 256 * c + 256,
                         lane_scales_vnni(sc + ((64 * c + 64) >> shift), m, idx), t1);
    }
    if (c < n) t0 = chunk8_vnni(_mm512_loadu_si512(w + 64 * c), xd + 256 * c, lane_scales_vnni(sc + (64 * c >> shift), m, idx), t0);
    return _mm512_add_ps(t0, t1);
}

/* one 4- or 8-bit row (packed values w; scales sp and biases bp where they lie, at code) . x:
 * its sums over x's digits (xd) and its biases . x's group sums times 2^-E (xs) in one register,
 * summed, times 2^E (unit); sc: scratch for the row's scales as float32 */
TARGET_VNNI static float row_vnni(const uint8_t *w, const uint8_t *sp, const uint8_t *bp, int64_t code, const uint8_t *xd,
                                  const float *xs, float unit, int64_t k, int64_t g, int64_t bits, float *sc) {
    const __m512 b = scales_vnni(sp, bp, code, xs, k / g, sc);
    return _mm512_reduce_add_ps(bits == 4 ? row4_vnni(w, sc, xd, k, g, b) : row8_vnni(w, sc, xd, k, g, b)) * unit;
}
#endif

#endif
