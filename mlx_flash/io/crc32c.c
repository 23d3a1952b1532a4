/* CRC32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of every bundle
 * part in a flash folder (layout/format.py). Hardware where the CPU has it, chosen at
 * run time: SSE4.2's crc32 instruction on x86-64, the ARMv8 CRC32 extension on arm64
 * (every Apple Silicon core); a table (slicing-by-8) elsewhere. Same results on all
 * paths: tests/test_checksums.py compares them with a bit-by-bit reference.
 *
 * crc32c_update(crc, buf, n) continues a checksum; a whole buffer's is
 * crc32c_update(0, buf, n) (the usual ~0 pre- and post-inversion are inside).
 *
 * The hardware instruction has a latency of ~3 cycles for 8 bytes, so one chain runs at a
 * third of its throughput: long buffers run as three chains over three adjacent blocks, the
 * first two moved past the others' bytes by an operator that appends n zero bytes to a CRC
 * register (linear over GF(2), applied by four table lookups) and XORed together. Reads
 * check every byte they place: on a 2-core machine the single chain was ~30 % of a mixture
 * of experts' read-ahead CPU time.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "crc32c.h"

static uint32_t table[8][256];
static int have_table;

/* ---- appending zero bytes to a raw CRC register: x -> x * x^(8n) mod P, linear over GF(2) */

static uint32_t gf2_times(const uint32_t *mat, uint32_t vec) { /* mat: 32 columns */
    uint32_t sum = 0;
    for (int i = 0; vec; i++, vec >>= 1)
        if (vec & 1) sum ^= mat[i];
    return sum;
}

static void gf2_square(uint32_t *out, const uint32_t *mat) {
    for (int i = 0; i < 32; i++) out[i] = gf2_times(mat, mat[i]);
}

/* the register after n zero bytes follow `crc` (n >= 1), by squaring the one-bit operator */
static uint32_t append_zeros(uint32_t crc, size_t n) {
    uint32_t a[32], b[32];
    a[0] = 0x82F63B78u; /* one zero bit: shift right, the polynomial where bit 0 falls out */
    for (int i = 1; i < 32; i++) a[i] = 1u << (i - 1);
    gf2_square(b, a); /* two bits */
    gf2_square(a, b); /* four bits */
    for (;;) {
        gf2_square(b, a); /* 8, 32, 128, ... bits: bytes 1, 4, 16, ... */
        if (n & 1) crc = gf2_times(b, crc);
        if (!(n >>= 1)) return crc;
        gf2_square(a, b); /* bytes 2, 8, 32, ... */
        if (n & 1) crc = gf2_times(a, crc);
        if (!(n >>= 1)) return crc;
    }
}

/* z[k][i]: append_zeros(i << 8k, n): four lookups append n zero bytes to any register */
static void make_zeros(uint32_t z[4][256], size_t n) {
    uint32_t col[32];
    for (int j = 0; j < 32; j++) col[j] = append_zeros(1u << j, n);
    for (int k = 0; k < 4; k++)
        for (uint32_t i = 0; i < 256; i++) z[k][i] = gf2_times(col, i << (8 * k));
}

static inline uint32_t shift_zeros(uint32_t z[4][256], uint32_t crc) {
    return z[0][crc & 0xFF] ^ z[1][(crc >> 8) & 0xFF] ^ z[2][(crc >> 16) & 0xFF] ^ z[3][crc >> 24];
}

#define LONG_BLOCK 8192 /* bytes a chain takes at a time: three chains need 3 * this */
#define SHORT_BLOCK 256
static uint32_t zeros_long[4][256], zeros_short[4][256];

static void make_table(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1)));
        table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++) table[t][i] = (table[t - 1][i] >> 8) ^ table[0][table[t - 1][i] & 0xFF];
    make_zeros(zeros_long, LONG_BLOCK);
    make_zeros(zeros_short, SHORT_BLOCK);
    have_table = 1;
}

static uint32_t crc_soft(uint32_t crc, const unsigned char *p, size_t n) {
    if (!have_table) make_table(); /* idempotent: racing threads write the same values */
    while (n && ((uintptr_t)p & 7)) {
        crc = (crc >> 8) ^ table[0][(crc ^ *p++) & 0xFF];
        n--;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= crc; /* little-endian: the low byte first */
        crc = table[7][w & 0xFF] ^ table[6][(w >> 8) & 0xFF] ^ table[5][(w >> 16) & 0xFF] ^
              table[4][(w >> 24) & 0xFF] ^ table[3][(w >> 32) & 0xFF] ^ table[2][(w >> 40) & 0xFF] ^
              table[1][(w >> 48) & 0xFF] ^ table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) crc = (crc >> 8) ^ table[0][(crc ^ *p++) & 0xFF];
    return crc;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HW_CRC 1
#define HW_TARGET __attribute__((target("sse4.2")))
HW_TARGET static inline uint32_t crc_byte(uint32_t c, unsigned char b) { return _mm_crc32_u8(c, b); }
HW_TARGET static inline uint32_t crc_word(uint32_t c, const unsigned char *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return (uint32_t)_mm_crc32_u64(c, w);
}
static int hw_available(void) { /* 0 or 1 (the builtin returns a feature's bit, not 1) */
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2") != 0;
}
#elif defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
/* Apple clang enables the CRC32 extension for every arm64 target; GCC on Linux aarch64 only
 * with -march=armv8-a+crc (else the table path below: correct, ~5x slower) */
#include <arm_acle.h>
#define HW_CRC 1
#define HW_TARGET
static inline uint32_t crc_byte(uint32_t c, unsigned char b) { return __crc32cb(c, b); }
static inline uint32_t crc_word(uint32_t c, const unsigned char *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return __crc32cd(c, w);
}
static int hw_available(void) { return 1; } /* compiled for a CPU that has it */
#endif

#ifdef HW_CRC
/* three chains over blocks of `block` bytes each while 3 * block remain -> the register */
HW_TARGET static inline uint32_t crc_three(uint32_t c, const unsigned char **pp, size_t *nn, size_t block,
                                           uint32_t z[4][256]) {
    const unsigned char *p = *pp;
    size_t n = *nn;
    while (n >= 3 * block) {
        uint32_t c1 = 0, c2 = 0;
        for (size_t i = 0; i < block; i += 8) {
            c = crc_word(c, p + i);
            c1 = crc_word(c1, p + block + i);
            c2 = crc_word(c2, p + 2 * block + i);
        }
        c = shift_zeros(z, c) ^ c1;
        c = shift_zeros(z, c) ^ c2;
        p += 3 * block;
        n -= 3 * block;
    }
    *pp = p, *nn = n;
    return c;
}

HW_TARGET static uint32_t crc_hw(uint32_t c, const unsigned char *p, size_t n) {
    while (n && ((uintptr_t)p & 7)) {
        c = crc_byte(c, *p++);
        n--;
    }
    c = crc_three(c, &p, &n, LONG_BLOCK, zeros_long);
    c = crc_three(c, &p, &n, SHORT_BLOCK, zeros_short);
    for (; n >= 8; p += 8, n -= 8) c = crc_word(c, p);
    while (n--) c = crc_byte(c, *p++);
    return c;
}
#endif

static int mode = -1; /* -1: not chosen yet, 0: table, 1: hardware */

int crc32c_hardware(int set) {
    if (!have_table) make_table(); /* the module's import calls this: the table exists before any
                                      worker thread can read it */
    if (set >= 0) {
#ifdef HW_CRC
        mode = set && hw_available();
#else
        mode = 0;
#endif
    } else if (mode < 0) {
#ifdef HW_CRC
        mode = hw_available();
#else
        mode = 0;
#endif
    }
    return mode;
}

uint32_t crc32c_update(uint32_t crc, const void *buf, size_t n) {
    if (mode < 0) crc32c_hardware(-1);
    crc = ~crc;
#ifdef HW_CRC
    if (mode == 1) return ~crc_hw(crc, (const unsigned char *)buf, n);
#endif
    return ~crc_soft(crc, (const unsigned char *)buf, n);
}
