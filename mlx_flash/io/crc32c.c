/* CRC32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of every bundle
 * part in a flash folder (layout/format.py). Hardware where the CPU has it, chosen at
 * run time: SSE4.2's crc32 instruction on x86-64, the ARMv8 CRC32 extension on arm64
 * (every Apple Silicon core); a table (slicing-by-8) elsewhere. Same results on all
 * paths: tests/test_checksums.py compares them with a bit-by-bit reference.
 *
 * crc32c_update(crc, buf, n) continues a checksum; a whole buffer's is
 * crc32c_update(0, buf, n) (the usual ~0 pre- and post-inversion are inside).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "crc32c.h"

static uint32_t table[8][256];
static int have_table;

static void make_table(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1)));
        table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++) table[t][i] = (table[t - 1][i] >> 8) ^ table[0][table[t - 1][i] & 0xFF];
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
__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const unsigned char *p, size_t n) {
    uint64_t c = crc;
    while (n && ((uintptr_t)p & 7)) {
        c = _mm_crc32_u8((uint32_t)c, *p++);
        n--;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = _mm_crc32_u64(c, w);
        p += 8;
        n -= 8;
    }
    while (n--) c = _mm_crc32_u8((uint32_t)c, *p++);
    return (uint32_t)c;
}
static int hw_available(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2");
}
#elif defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
/* Apple clang enables the CRC32 extension for every arm64 target; GCC on Linux aarch64 only
 * with -march=armv8-a+crc (else the table path below: correct, ~5x slower) */
#include <arm_acle.h>
#define HW_CRC 1
static uint32_t crc_hw(uint32_t crc, const unsigned char *p, size_t n) {
    while (n && ((uintptr_t)p & 7)) {
        crc = __crc32cb(crc, *p++);
        n--;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        crc = __crc32cd(crc, w);
        p += 8;
        n -= 8;
    }
    while (n--) crc = __crc32cb(crc, *p++);
    return crc;
}
static int hw_available(void) { return 1; } /* compiled for a CPU that has it */
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
