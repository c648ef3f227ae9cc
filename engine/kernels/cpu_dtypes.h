/* The element types of the CPU kernels: float32, or bfloat16 held as a float32's high half; the
 * float32 functions the kernels share (exp, tanh), written so that loops over them vectorize;
 * and the small helpers more than one source file needs (per-thread scratch, tail masks). */
#ifndef PDCLUSTER_CPU_DTYPES_H
#define PDCLUSTER_CPU_DTYPES_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

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

/* This thread's scratch of at least `bytes`, kept between calls (NULL: no memory); one buffer
 * per thread and source file. A malloc of megabytes is a fresh mmap whose pages the kernel
 * zeroes at first touch: on every layer's call, 7% of a 4k-token prefill's attention. Grows to
 * the largest need, then stays. */
static inline void *thread_scratch(int64_t bytes) {
    static __thread void *held = NULL;
    static __thread int64_t held_bytes = 0;
    if (bytes > held_bytes) {
        free(held);
        held = malloc(bytes);
        held_bytes = held != NULL ? bytes : 0;
    }
    return held;
}

#ifdef __AVX512F__
/* Lanes of [j, j + 16) below n: the mask of a 16-lane loop's last, part vector. */
static inline __mmask16 lanes_below(int64_t j, int64_t n) {
    return n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1u);
}
#endif

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
#ifdef __AVX2__
    /* one vpmovzxwd from memory and a shift: GCC made the conversion below of two 128-bit
     * halves and an insert, which held a long-context decode's attention to 5-7 GB/s */
    const __m128i *h = (const __m128i *)((const uint16_t *)p + at);
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(h));
    return (v8f)_mm256_slli_epi32(wide, 16);
#else
    v8u16 h;
    memcpy(&h, (const uint16_t *)p + at, sizeof h);
    v8u32 bits = __builtin_convertvector(h, v8u32) << 16;
    v8f v;
    memcpy(&v, &bits, sizeof v);
    return v;
#endif
}

/* exp(x) in float32 to about one unit in the last place (Cephes' expf: x = n ln2 + r, a
 * degree-6 polynomial for e^r, 2^n put in the exponent bits). Unlike libm's expf it has no call
 * and no branch, so loops over rows of values vectorize. x is clamped to [-87, 88]: e^-87 is
 * 1.6e-38 (nothing next to a softmax row's maximum of e^0, or to SiLU's 1 + e^x), e^88 is
 * 1.7e38 (where libm would give infinity, SiLU's x / (1 + e^-x) is 0 either way). */
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    float n = rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

/* tanh(x) in float32 to a unit or two in the last place (Cephes' tanhf: an odd polynomial below
 * |x| = 0.625, 1 - 2 / (e^2|x| + 1) above), both computed and one picked, so that it vectorizes
 * where libm's tanhf is a call per value (a soft-capped prefill spent most of its time there).
 * Beyond |x| = 44 e^2|x| is clamped and the result is exactly +-1, as tanhf's. */
static inline float tanh_clamped(float x) {
    float a = fabsf(x), z = x * x;
    float big = 1.0f - 2.0f / (exp_clamped(2.0f * a) + 1.0f);
    float small = ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z - 5.37397155531e-2f) * z +
                    1.33314422036e-1f) * z - 3.33332819422e-1f) * z * x + x;
    return a > 0.625f ? copysignf(big, x) : small;
}

/* silu(x) = x / (1 + e^-x), torch's vectorised formula (the MLPs' and the experts'). */
static inline float silu(float x) {
    float y = x / (1.0f + exp_clamped(-x));
    return x == -INFINITY ? NAN : y; /* torch: -inf / inf */
}

#ifdef __AVX512F__
/* exp_clamped on 16 lanes: the same clamp, reduction and polynomial. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 y = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}
#endif

#endif
