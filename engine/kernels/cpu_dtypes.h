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

/* Eight float32 lanes in GCC's vector extensions: one AVX register (half of an AVX-512 one),
 * or two SSE ones where that is all the host has; the kernels build for any -march=native. */
typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f splat(float s) { return (v8f){s, s, s, s, s, s, s, s}; }

/* Eight values from element `at` of p, as float32 (bfloat16 is a float32's high half). */
static inline __attribute__((always_inline)) v8f load8(const void *p, int64_t at,
                                                       const int dtype) {
    if (dtype == F32) {
        v8f v;
        memcpy(&v, (const float *)p + at, sizeof v);
        return v;
    }
    v8u16 h;
    memcpy(&h, (const uint16_t *)p + at, sizeof h);
    v8u32 bits = __builtin_convertvector(h, v8u32) << 16;
    v8f v;
    memcpy(&v, &bits, sizeof v);
    return v;
}
#endif
