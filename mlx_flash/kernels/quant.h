/* Numeric helpers shared by the reader (io/_native.c: dequantize on copy) and the
 * quantized matvec (kernels/_matvec.c): dtype codes, IEEE half -> float, one scale
 * or bias at its dtype, and unpacking MLX's group-wise packed values. */
#ifndef MLX_FLASH_QUANT_H
#define MLX_FLASH_QUANT_H

#include <stdint.h>
#include <string.h>

enum { F32 = 0, F16 = 1, BF16 = 2 }; /* dtype codes, same as reader.py */

static inline float f32_from_bits(uint32_t w) { float f; memcpy(&f, &w, 4); return f; }
static inline uint32_t f32_to_bits(float f) { uint32_t w; memcpy(&w, &f, 4); return w; }

/* IEEE half -> float, exact for every input including subnormals, inf, NaN.
 * After M. Dukhan's FP16 library (MIT): normal numbers are rebuilt by moving
 * the exponent/mantissa into place and rescaling by 2^-112 (which also maps
 * the half inf/NaN exponent to the float one); subnormals by the magic-number
 * subtraction 0.5 + m * 2^-24 - 0.5. */
static inline float half_to_float(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const float normal = f32_from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float subnormal = f32_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
    const uint32_t is_sub = (uint32_t)0 - (uint32_t)(two_w < (1u << 27)); /* all ones or 0 */
    const uint32_t r = (f32_to_bits(subnormal) & is_sub) | (f32_to_bits(normal) & ~is_sub);
    return f32_from_bits(sign | r);
}

#define QINLINE static inline __attribute__((always_inline))

QINLINE float load_scale(const uint8_t *p, int64_t code) {
    if (code == F32) {
        float f;
        memcpy(&f, p, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, p, 2);
    return code == F16 ? half_to_float(h) : f32_from_bits((uint32_t)h << 16);
}

/* values 0 .. m-1 of the bit stream at p -> q; m * bits is a multiple of 8 */
QINLINE void unpack_bits(const uint8_t *restrict p, int64_t bits, int64_t m, uint8_t *restrict q) {
    if (bits == 4) {
        for (int64_t i = 0; i < m / 2; i++) {
            q[2 * i] = p[i] & 15;
            q[2 * i + 1] = p[i] >> 4;
        }
    } else if (bits == 2) {
        for (int64_t i = 0; i < m / 4; i++) {
            const uint8_t x = p[i];
            q[4 * i] = x & 3;
            q[4 * i + 1] = (x >> 2) & 3;
            q[4 * i + 2] = (x >> 4) & 3;
            q[4 * i + 3] = x >> 6;
        }
    } else { /* 3, 5, 6 bits: 8 values in `bits` bytes (6 bits: a tail of 4 in 3) */
        const uint64_t mask = ((uint64_t)1 << bits) - 1;
        int64_t j = 0;
        for (; j + 8 <= m; j += 8, p += bits) {
            uint64_t x = 0;
            for (int64_t b = 0; b < bits; b++) x |= (uint64_t)p[b] << (8 * b);
            for (int k = 0; k < 8; k++) q[j + k] = (uint8_t)((x >> (k * bits)) & mask);
        }
        if (j < m) {
            uint64_t x = 0;
            for (int64_t b = 0; b < (m - j) * bits / 8; b++) x |= (uint64_t)p[b] << (8 * b);
            for (int64_t k = 0; j + k < m; k++) q[j + k] = (uint8_t)((x >> (k * bits)) & mask);
        }
    }
}

#endif
