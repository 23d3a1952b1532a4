/* qaxpy_cols in integers on x86-64 CPUs with AVX-512 VNNI and VBMI (the kernels' SIMD level 3 where
 * the CPU also has VBMI: Intel Ice Lake and later, AMD Zen 4 and later), included by _matvec.c after
 * vnni.h.
 *
 * A FFN's down projection is held as columns (a neuron's values for every output, the flash
 * bundle's layout), grouped by table row t (the neuron's group of g: the scales and biases
 * ts[t][c], tb[t][c] along the outputs c). A run of the rows sharing t contributes
 *
 *     y[c] += ts[t][c] * sum_i h_i q_i[c] + tb[t][c] * sum_i h_i
 *
 * The float32 loops widen every value q_i[c] to a lane and multiply it by h_i. Here the run's h are
 * written once a call as three signed 8-bit digits each over one unit of the run, a power of two,
 * as vnni.h writes x over each lane's unit:
 *
 *     h_i = u * N_i + r_i,  N_i = round(h_i / u) = d0 * 2^16 + d1 * 2^8 + d2,  |r_i| <= u / 2
 *
 * with u = 2^(f - 22), 2^f <= max_i |h_i| < 2^(f + 1) (2^(f - 21) where the largest would round
 * to d0 = 128): each h to float32's rounding of the run's largest. vpdpbusd then multiplies 4
 * columns' values at once: an int32 lane holds one output c's 4 bytes, one of each column (a
 * byte permute, vpermt2b, interleaves 4 columns' packed bytes), against the 4 columns' digit d
 * broadcast to every lane; each digit's sums are exact in int32 over the run (at most
 * 128 * 255 * 128 < 2^23 a digit), combined as (a0 * 2^8 + a1) * 2^8 + a2 in float32 (one or two
 * roundings of 2^-24), times u (scalef: exact, or float32's own underflow), then the tables as the
 * float32 loops apply them. So the column sums are the float32 loops' to their rounding, not to
 * the bit (tests/test_kernels.py holds them to float64); a part that continues another's sums
 * (hybrid: held rows, then streamed ones) gives one call's values where the parts meet at a
 * table row, as on every level.
 *
 * Cost: per 4 columns and 64 outputs (4 bits): 4 loads, 2 byte permutes, 6 nibble operations,
 * 12 vpdpbusd; the float32 loop spent ~64 vector operations on the same values. A run ends
 * with the conversion and the tables (~15 operations per 16 outputs).
 *
 * A call whose h holds an infinity or a NaN takes the float32 loops (their NaNs, where they put
 * them).
 */
#ifndef MLX_FLASH_VNNI_COLS_H
#define MLX_FLASH_VNNI_COLS_H

#ifdef VNNI_PATH
#define VNNI_COLS_PATH 1
#define TARGET_VNNI_COLS __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")))

static int cpu_vbmi(void) { return __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512vl"); }

/* a run of rows sharing a table row: its quads of 4 columns, its unit's exponent, its h's sum */
typedef struct {
    int64_t t, q0, nq;
    int ue;
    float hs;
} colrun_t;

/* qaxpy_cols's h prepared once a call: the runs, each quad's 4 column indices (a run's last
 * quad padded with its last column, digit 0) and the quad's 4 digits d0, d1, d2 (4 bytes each) */
typedef struct {
    colrun_t *runs;
    int64_t nruns;
    int64_t *cols;   /* [quads][4] */
    int32_t *digits; /* [3][stride]: digit z of quad q at z * stride + q */
    int64_t stride;
} colprep_t;

static void free_cols_vnni(colprep_t *p) {
    free(p->runs);
    free(p->cols);
    free(p->digits);
    memset(p, 0, sizeof *p);
}

/* h [m], rows sel ordered by trow -> p (free_cols_vnni it): 0, -1 where h is not all finite
 * (no allocation then) or memory ran out. 16 values a step: a run's largest, its unit, then N
 * rounded (to the nearest, ties to even), whose bytes N + 0x8080 hold d0, d1 + 128, d2 + 128
 * (vnni.h's digits_vnni): one byte a value, 4 values a quad, each digit's 4 quads in 16 bytes */
TARGET_VNNI_COLS static int prepare_cols_vnni(const float *h, const int64_t *sel, const int64_t *trow, int64_t m,
                                              colprep_t *p) {
    memset(p, 0, sizeof *p);
    const __m512 inf = _mm512_set1_ps(INFINITY);
    __mmask16 bad = 0;
    int64_t i = 0;
    for (; i + 16 <= m; i += 16) bad |= _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(h + i)), inf, _CMP_NLT_UQ);
    for (; i < m; i++) bad |= !isfinite(h[i]);
    if (bad) return -1;
    int64_t quads = 0, runs = 0;
    for (i = 0; i < m;) {
        int64_t e = i;
        while (e < m && trow[e] == trow[i]) e++;
        quads += (e - i + 3) / 4, runs++, i = e;
    }
    const int64_t qa = (quads + 3) / 4 * 4 + 4; /* (16-byte stores of 4 quads past a run's last) */
    p->runs = malloc(sizeof(colrun_t) * (size_t)(runs ? runs : 1));
    p->cols = malloc(sizeof(int64_t) * 4 * (size_t)qa);
    p->digits = malloc(sizeof(int32_t) * 3 * (size_t)qa);
    if (!p->runs || !p->cols || !p->digits) {
        free_cols_vnni(p);
        return -1;
    }
    p->stride = qa;
    const __m512i bias = _mm512_set1_epi32(0x8080), flip = _mm512_set1_epi32(0x80);
    int64_t q = 0;
    for (i = 0; i < m;) {
        int64_t e = i;
        while (e < m && trow[e] == trow[i]) e++;
        const int64_t len = e - i, nq = (len + 3) / 4;
        __m512 top = _mm512_setzero_ps(), sum = _mm512_setzero_ps();
        for (int64_t a = 0; a < len; a += 16) {
            const __mmask16 mk = (__mmask16)(len - a >= 16 ? 0xffff : (1u << (len - a)) - 1);
            const __m512 v = _mm512_maskz_loadu_ps(mk, h + i + a);
            top = _mm512_max_ps(top, _mm512_abs_ps(v));
            sum = _mm512_add_ps(sum, v);
        }
        const float largest = _mm512_reduce_max_ps(top);
        int ue = 0;
        if (largest > 0) {
            int ex;
            frexpf(largest, &ex); /* largest = fr * 2^ex, fr in [0.5, 1): f = ex - 1 */
            ue = ex - 1 - 22;
            if (rint(ldexp((double)largest, -ue)) > 8355711.0) ue++;
        }
        colrun_t *r = p->runs + p->nruns++;
        r->t = trow[i], r->q0 = q, r->nq = nq, r->ue = ue, r->hs = _mm512_reduce_add_ps(sum);
        const __m512 down = _mm512_set1_ps((float)-ue);
        for (int64_t a = 0; a < len; a += 16) { /* 4 quads a step (past the run's last: zeros, overwritten) */
            const __mmask16 mk = (__mmask16)(len - a >= 16 ? 0xffff : (1u << (len - a)) - 1);
            const __m512i n = _mm512_cvt_roundps_epi32(_mm512_scalef_ps(_mm512_maskz_loadu_ps(mk, h + i + a), down),
                                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m512i b = _mm512_add_epi32(n, bias);
            const int64_t at = q + a / 4;
            _mm_storeu_si128((__m128i *)(p->digits + at), _mm512_cvtepi32_epi8(_mm512_srli_epi32(b, 16)));
            _mm_storeu_si128((__m128i *)(p->digits + qa + at), _mm512_cvtepi32_epi8(_mm512_xor_si512(_mm512_srli_epi32(b, 8), flip)));
            _mm_storeu_si128((__m128i *)(p->digits + 2 * qa + at), _mm512_cvtepi32_epi8(_mm512_xor_si512(b, flip)));
        }
        /* (the zeros' digits past the run's last: N 0 -> d0 0, d1 0, d2 0) */
        int64_t *cq = p->cols + 4 * q;
        for (int64_t a = 0; a < 4 * nq; a++) cq[a] = sel[i + (a < len ? a : len - 1)];
        q += nq, i = e;
    }
    return 0;
}

/* a run's digit sums (a0, a1, a2: int32 lanes) -> its float32 sums times 2^ue */
TARGET_VNNI_COLS static inline __m512 sums_vnni(__m512i a0, __m512i a1, __m512i a2, __m512 ue) {
    return _mm512_scalef_ps(digit_sums_vnni(a0, a1, a2), ue);
}

/* y[0 .. 15] += ts * acc + tb * hs (a multiply, a multiply, then the adds, as the float32 loops) */
TARGET_VNNI_COLS static inline void apply16_vnni(const uint8_t *sr, const uint8_t *br, int64_t code, __m512 acc, __m512 hs,
                                                 float *y) {
    const __m512 a = _mm512_mul_ps(load_scales_vnni(sr, code, 0xffff), acc);
    const __m512 b = _mm512_mul_ps(load_scales_vnni(br, code, 0xffff), hs);
    _mm512_storeu_ps(y, _mm512_add_ps(_mm512_loadu_ps(y), _mm512_add_ps(a, b)));
}

/* the next run's columns' bytes [from, from + len) asked for ahead of their products */
static inline void prefetch_cols_vnni(const uint8_t *w, int64_t row_bytes, const int64_t *cols, int64_t nq, int64_t from,
                                      int64_t len) {
    for (int64_t i = 0; i < 4 * nq; i++) {
        if (i % 4 && cols[i] == cols[i - 1]) continue; /* (a padded quad) */
        const uint8_t *p = w + cols[i] * row_bytes + from;
        for (int64_t o = 0; o < len; o += 64) _mm_prefetch((const char *)p + o, _MM_HINT_T0);
    }
}

/* vpermt2b's index over X = A | B, Y = C | D (4 columns' 32 bytes each): lane l's 4 bytes are byte
 * l of A, B, C, D (add 16 for bytes 16 + l) */
TARGET_VNNI_COLS static inline __m512i interleave4_vnni(void) {
    static const uint8_t ix[64] = {0,  32, 64, 96,  1,  33, 65, 97,  2,  34, 66, 98,  3,  35, 67, 99,
                                   4,  36, 68, 100, 5,  37, 69, 101, 6,  38, 70, 102, 7,  39, 71, 103,
                                   8,  40, 72, 104, 9,  41, 73, 105, 10, 42, 74, 106, 11, 43, 75, 107,
                                   12, 44, 76, 108, 13, 45, 77, 109, 14, 46, 78, 110, 15, 47, 79, 111};
    return _mm512_loadu_si512(ix);
}

/* one run of 4-bit columns, outputs [c0, c0 + n) (n % 32 == 0) added to y (y + c0 on) */
TARGET_VNNI_COLS static void run4_cols_vnni(const uint8_t *w, int64_t row_bytes, const colprep_t *p, const colrun_t *r,
                                            int64_t c0, int64_t n, const uint8_t *sr, const uint8_t *br, int64_t code,
                                            float *y) {
    const __m512i i0 = interleave4_vnni(), i1 = _mm512_add_epi8(i0, _mm512_set1_epi8(16));
    /* even outputs' lanes and odd outputs' back in order: c 2l from E, 2l + 1 from O */
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    const __m512i m15 = _mm512_set1_epi8(15);
    const __m512 ue = _mm512_set1_ps((float)r->ue), hs = _mm512_set1_ps(r->hs);
    const int64_t ssz = code == F32 ? 4 : 2;
    const int64_t *cols = p->cols + 4 * r->q0;
    const int32_t *dg = p->digits + r->q0, *dg1 = dg + p->stride, *dg2 = dg + 2 * p->stride;
    for (int64_t c = 0; c < n; c += 64) {
        const int whole = n - c >= 64;
        const __mmask32 ld = whole ? 0xffffffffu : 0xffffu; /* 32 bytes a column, or 16 */
        __m512i e0[3], o0[3], e1[3], o1[3];
        for (int z = 0; z < 3; z++) e0[z] = o0[z] = e1[z] = o1[z] = _mm512_setzero_si512();
        const uint8_t *base = w + (c0 + c) / 2;
        for (int64_t q = 0; q < r->nq; q++) {
            const int64_t *cq = cols + 4 * q;
            const __m512i X = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_maskz_loadu_epi8(ld, base + cq[0] * row_bytes)),
                                                 _mm256_maskz_loadu_epi8(ld, base + cq[1] * row_bytes), 1);
            const __m512i Y = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_maskz_loadu_epi8(ld, base + cq[2] * row_bytes)),
                                                 _mm256_maskz_loadu_epi8(ld, base + cq[3] * row_bytes), 1);
            const __m512i R0 = _mm512_permutex2var_epi8(X, i0, Y);
            const __m512i d[3] = {_mm512_set1_epi32(dg[q]), _mm512_set1_epi32(dg1[q]), _mm512_set1_epi32(dg2[q])};
            const __m512i l0 = _mm512_and_si512(R0, m15), h0 = _mm512_and_si512(_mm512_srli_epi16(R0, 4), m15);
            for (int z = 0; z < 3; z++) e0[z] = _mm512_dpbusd_epi32(e0[z], l0, d[z]), o0[z] = _mm512_dpbusd_epi32(o0[z], h0, d[z]);
            if (whole) {
                const __m512i R1 = _mm512_permutex2var_epi8(X, i1, Y);
                const __m512i l1 = _mm512_and_si512(R1, m15), h1 = _mm512_and_si512(_mm512_srli_epi16(R1, 4), m15);
                for (int z = 0; z < 3; z++)
                    e1[z] = _mm512_dpbusd_epi32(e1[z], l1, d[z]), o1[z] = _mm512_dpbusd_epi32(o1[z], h1, d[z]);
            }
        }
        const __m512 fe0 = sums_vnni(e0[0], e0[1], e0[2], ue), fo0 = sums_vnni(o0[0], o0[1], o0[2], ue);
        const int64_t at = c0 + c;
        apply16_vnni(sr + at * ssz, br + at * ssz, code, _mm512_permutex2var_ps(fe0, lo, fo0), hs, y + at);
        apply16_vnni(sr + (at + 16) * ssz, br + (at + 16) * ssz, code, _mm512_permutex2var_ps(fe0, hi, fo0), hs, y + at + 16);
        if (whole) {
            const __m512 fe1 = sums_vnni(e1[0], e1[1], e1[2], ue), fo1 = sums_vnni(o1[0], o1[1], o1[2], ue);
            apply16_vnni(sr + (at + 32) * ssz, br + (at + 32) * ssz, code, _mm512_permutex2var_ps(fe1, lo, fo1), hs, y + at + 32);
            apply16_vnni(sr + (at + 48) * ssz, br + (at + 48) * ssz, code, _mm512_permutex2var_ps(fe1, hi, fo1), hs, y + at + 48);
        }
    }
}

/* one run of 8-bit columns, as run4_cols_vnni: 32 outputs a step */
TARGET_VNNI_COLS static void run8_cols_vnni(const uint8_t *w, int64_t row_bytes, const colprep_t *p, const colrun_t *r,
                                            int64_t c0, int64_t n, const uint8_t *sr, const uint8_t *br, int64_t code,
                                            float *y) {
    const __m512i i0 = interleave4_vnni(), i1 = _mm512_add_epi8(i0, _mm512_set1_epi8(16));
    const __m512 ue = _mm512_set1_ps((float)r->ue), hs = _mm512_set1_ps(r->hs);
    const int64_t ssz = code == F32 ? 4 : 2;
    const int64_t *cols = p->cols + 4 * r->q0;
    const int32_t *dg = p->digits + r->q0, *dg1 = dg + p->stride, *dg2 = dg + 2 * p->stride;
    for (int64_t c = 0; c < n; c += 32) {
        __m512i a[3], b[3];
        for (int z = 0; z < 3; z++) a[z] = b[z] = _mm512_setzero_si512();
        const uint8_t *base = w + c0 + c;
        for (int64_t q = 0; q < r->nq; q++) {
            const int64_t *cq = cols + 4 * q;
            const __m512i X = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(base + cq[0] * row_bytes))),
                                                 _mm256_loadu_si256((const __m256i *)(base + cq[1] * row_bytes)), 1);
            const __m512i Y = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(base + cq[2] * row_bytes))),
                                                 _mm256_loadu_si256((const __m256i *)(base + cq[3] * row_bytes)), 1);
            const __m512i R0 = _mm512_permutex2var_epi8(X, i0, Y), R1 = _mm512_permutex2var_epi8(X, i1, Y);
            for (int z = 0; z < 3; z++) {
                const __m512i d = _mm512_set1_epi32((z == 0 ? dg : z == 1 ? dg1 : dg2)[q]);
                a[z] = _mm512_dpbusd_epi32(a[z], R0, d), b[z] = _mm512_dpbusd_epi32(b[z], R1, d);
            }
        }
        const int64_t at = c0 + c;
        apply16_vnni(sr + at * ssz, br + at * ssz, code, sums_vnni(a[0], a[1], a[2], ue), hs, y + at);
        apply16_vnni(sr + (at + 16) * ssz, br + (at + 16) * ssz, code, sums_vnni(b[0], b[1], b[2], ue), hs, y + at + 16);
    }
}

/* QAXPY_COLS over outputs [c0, c1) (multiples of 32) from the prepared h: each run's columns, the
 * next run's asked for meanwhile */
static void qaxpy_cols_vnni(const colprep_t *p, const uint8_t *w, int64_t row_bytes, int64_t bits, const uint8_t *ts,
                            const uint8_t *tb, int64_t t_stride, int64_t code, int64_t c0, int64_t c1, float *y) {
    for (int64_t k = 0; k < p->nruns; k++) {
        const colrun_t *r = p->runs + k;
        if (k + 1 < p->nruns) /* (on this Xeon VM, 28 layers' 4-bit down columns from DRAM: 7.4-7.9 GB/s
                                 without, 8.2-8.7 with; two runs ahead or into L2 only no better) */
            prefetch_cols_vnni(w, row_bytes, p->cols + 4 * r[1].q0, r[1].nq, c0 * bits / 8, (c1 - c0) * bits / 8);
        const uint8_t *sr = ts + r->t * t_stride, *br = tb + r->t * t_stride;
        if (bits == 4)
            run4_cols_vnni(w, row_bytes, p, r, c0, c1 - c0, sr, br, code, y);
        else
            run8_cols_vnni(w, row_bytes, p, r, c0, c1 - c0, sr, br, code, y);
    }
}
#endif

#endif
