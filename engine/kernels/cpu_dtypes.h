/* The element types of the CPU kernels: float32, or bfloat16 held as a float32's high half. */
#ifndef PDCLUSTER_CPU_DTYPES_H
#define PDCLUSTER_CPU_DTYPES_H
#include <stdint.h>
#include <string.h>

enum { F32 = 0, BF16 = 1 };

static inline float from_bf16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float32 -> bfloat16, rounding to nearest even as torch does (NaN stays NaN). */
static inline uint16_t to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* The value as the tensor's dtype holds it: rounded to bfloat16 where the model rounds. */
static inline float held(float f, int dtype) {
    return dtype == F32 ? f : from_bf16(to_bf16(f));
}

static inline float get(const void *p, int64_t i, int dtype) {
    return dtype == F32 ? ((const float *)p)[i] : from_bf16(((const uint16_t *)p)[i]);
}

static inline void put(void *p, int64_t i, float f, int dtype) {
    if (dtype == F32)
        ((float *)p)[i] = f;
    else
        ((uint16_t *)p)[i] = to_bf16(f);
}
#endif
