/* A bfloat16 model's row kernels on AVX-512's 16 lanes: RMSNorm (with its residual add), the
 * per-head q/k norms, the rotary embedding and SiLU(gate) * up, the element-wise passes between
 * a prefill's matmuls. cpu_kernels.c hands them the bfloat16 rows where the CPU has
 * AVX512-BF16 and keeps its generic loops for float32, Gemma's GELU and other CPUs.
 *
 * Why: GCC vectorizes those loops for eight lanes (its -march=native default on AVX-512 hosts)
 * and rounds to bfloat16 with integer arithmetic (to_bf16's bias and shift, and the NaN test)
 * where `vcvtneps2bf16` is one instruction. On the Xeon host a Qwen2.5-0.5B prefill of 512
 * tokens spent 170 ms of its 770 in them (SiLU's product 4.4 ms a layer), a fifth of what its
 * matmuls take. Here every value is computed in float32 as there, in the same order, and
 * rounded where they round: to nearest even, NaN kept a NaN; `vcvtneps2bf16` differs from
 * to_bf16 only on float32 subnormals (below 1.2e-38, flushed to zero). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_dtypes.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>

int rows_bf16_available(void) { return 1; }

static inline __m512 load16(const uint16_t *p, __mmask16 m) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

static inline void store16(uint16_t *p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

/* The value as a bfloat16 tensor holds it (cpu_dtypes.h's held). */
static inline __m512 held16(__m512 v) {
    __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* cpu_kernels.c's norm_row for bfloat16: x * rsqrt(mean(x^2) + eps) in float32, then Llama's
 * rounding (held, times the weight, rounded) or Gemma's (times 1 + weight, rounded once). */
static inline void norm_row16(const uint16_t *x, const uint16_t *weight, uint16_t *out,
                              int64_t dim, float eps, int gemma) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < dim; j += 16) {
        __m512 v = load16(x + j, lanes_below(j, dim));
        sum = _mm512_fmadd_ps(v, v, sum);
    }
    __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(sum) / (float)dim + eps));
    for (int64_t j = 0; j < dim; j += 16) {
        __mmask16 m = lanes_below(j, dim);
        __m512 v = _mm512_mul_ps(load16(x + j, m), inv), w = load16(weight + j, m);
        __m512 y = gemma ? _mm512_mul_ps(v, _mm512_add_ps(w, _mm512_set1_ps(1.0f)))
                         : _mm512_mul_ps(w, held16(v));
        store16(out + j, y, m);
    }
}

/* cpu_kernels.c's rms_norm for bfloat16 rows. */
void rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *weight, uint16_t *out,
                   int64_t rows, int64_t dim, float eps, int gemma) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = x + r * dim;
        if (residual != NULL) {
            uint16_t *sum = residual + r * dim;
            for (int64_t j = 0; j < dim; j += 16) {
                __mmask16 m = lanes_below(j, dim);
                store16(sum + j, _mm512_add_ps(load16(sum + j, m), load16(row + j, m)), m);
            }
            row = sum;
        }
        norm_row16(row, weight, out + r * dim, dim, eps, gemma);
    }
}

/* cpu_kernels.c's rms_norm_heads for bfloat16, in place. */
void rms_norm_heads_bf16(uint16_t *x, int64_t token_stride, int64_t tokens, int64_t heads,
                         int64_t d, const uint16_t *weight, float eps, int gemma) {
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *row = x + t * token_stride + h * d;
            norm_row16(row, weight, row, d, eps, gemma);
        }
}

/* cpu_kernels.c's rope for bfloat16, in place: each half computed in float32 and rounded once. */
void rope_bf16(uint16_t *x, int64_t token_stride, int64_t tokens, int64_t heads, int64_t d,
               int64_t rotary_dim, const int64_t *positions, const float *cos, const float *sin) {
    int64_t half = rotary_dim / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + positions[t] * rotary_dim, *s = sin + positions[t] * rotary_dim;
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *row = x + t * token_stride + h * d;
            for (int64_t j = 0; j < half; j += 16) {
                __mmask16 m = lanes_below(j, half);
                __m512 x1 = load16(row + j, m), x2 = load16(row + j + half, m);
                __m512 c1 = _mm512_maskz_loadu_ps(m, c + j), s1 = _mm512_maskz_loadu_ps(m, s + j);
                __m512 c2 = _mm512_maskz_loadu_ps(m, c + j + half);
                __m512 s2 = _mm512_maskz_loadu_ps(m, s + j + half);
                store16(row + j, _mm512_sub_ps(_mm512_mul_ps(x1, c1), _mm512_mul_ps(x2, s1)), m);
                store16(row + j + half,
                        _mm512_add_ps(_mm512_mul_ps(x2, c2), _mm512_mul_ps(x1, s2)), m);
            }
        }
    }
}

/* cpu_kernels.c's silu_mul for bfloat16: silu(gate) = gate / (1 + e^-gate) rounded, times up,
 * rounded; a gate of -inf gives NaN (torch's -inf / inf). */
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter) {
    const __m512 one = _mm512_set1_ps(1.0f), minus_inf = _mm512_set1_ps(-INFINITY);
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + r * 2 * inter, *up = gate + inter;
        for (int64_t j = 0; j < inter; j += 16) {
            __mmask16 m = lanes_below(j, inter);
            __m512 g = load16(gate + j, m);
            __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
            __m512 a = _mm512_div_ps(g, _mm512_add_ps(one, e));
            a = _mm512_mask_mov_ps(a, _mm512_cmp_ps_mask(g, minus_inf, _CMP_EQ_OQ),
                                   _mm512_set1_ps(NAN));
            store16(out + r * inter + j, _mm512_mul_ps(held16(a), load16(up + j, m)), m);
        }
    }
}
#else
int rows_bf16_available(void) { return 0; }

/* Never called where rows_bf16_available() says 0 (cpu_kernels.c's dispatch). */
void rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *weight, uint16_t *out,
                   int64_t rows, int64_t dim, float eps, int gemma) {
    abort();
}

void rms_norm_heads_bf16(uint16_t *x, int64_t token_stride, int64_t tokens, int64_t heads,
                         int64_t d, const uint16_t *weight, float eps, int gemma) {
    abort();
}

void rope_bf16(uint16_t *x, int64_t token_stride, int64_t tokens, int64_t heads, int64_t d,
               int64_t rotary_dim, const int64_t *positions, const float *cos, const float *sin) {
    abort();
}

void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter) {
    abort();
}
#endif
