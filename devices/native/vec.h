// The portable vector layer every kernel is written over: 16 floats (or 16 int32s, 64 bytes) as one
// GCC/Clang vector type, which the compiler lowers to one AVX-512 register, two AVX2 ones, or four
// SSE/NEON ones, so the same source runs on every CPU the build targets (devices/cpu_native.py picks the
// level: x86-64-v2, -v3, -v4 or the machine's own). What the build has is known here at compile time
// (the ISA constants below); x86 intrinsics appear only under their feature macros, in the files that
// pay for them (products_x86.h, quantized.cpp), each with a portable path beside it.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TANDEM_X86 1
#else
#define TANDEM_X86 0
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace tandem {

// The build's vector registers: how wide, how many. The products choose their register blocks from
// these (how many rows and column blocks a pass keeps in registers).
#if defined(__AVX512F__)
constexpr int VECTOR_BYTES = 64, VECTOR_REGISTERS = 32;
#elif defined(__AVX2__) || defined(__AVX__)
constexpr int VECTOR_BYTES = 32, VECTOR_REGISTERS = 16;
#elif defined(__aarch64__)
constexpr int VECTOR_BYTES = 16, VECTOR_REGISTERS = 32;
#else
constexpr int VECTOR_BYTES = 16, VECTOR_REGISTERS = 16;
#endif
// 16-float vectors the registers hold at once (one Vec16 takes 64 / VECTOR_BYTES registers).
constexpr int VEC16_REGISTERS = VECTOR_REGISTERS * VECTOR_BYTES / 64;

typedef float Vec16 __attribute__((vector_size(64)));
typedef float Vec8 __attribute__((vector_size(32)));
typedef int32_t I32x16 __attribute__((vector_size(64)));
typedef uint32_t U32x16 __attribute__((vector_size(64)));
typedef uint16_t U16x16 __attribute__((vector_size(32)));
typedef int8_t I8x16 __attribute__((vector_size(16)));

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {      // bf16 is the top half of a float32 (a form loops vectorize)
  const uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// x rounded to T as static_cast<T> rounds it (to nearest, ties to even; NaN stays NaN), written for bf16
// with plain integer operations so that loops of it vectorize (c10's conversion is a call the compiler
// keeps scalar).
template <typename T>
inline T round_to(float x) { return static_cast<T>(x); }

template <>
inline c10::BFloat16 round_to<c10::BFloat16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return c10::BFloat16(static_cast<uint16_t>(x != x ? 0x7FC0u : rounded), c10::BFloat16::from_bits());
}

template <typename T>
constexpr bool VECTOR_TYPE = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

inline Vec16 splat(float x) { return Vec16{} + x; }

inline Vec16 load16(const float* p) {
  Vec16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline Vec16 load16(const c10::BFloat16* p) {      // bf16 is the top half of a float32
  U16x16 h;
  std::memcpy(&h, p, sizeof(h));
  const U32x16 w = __builtin_convertvector(h, U32x16) << 16;
  Vec16 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}

// Sixteen int8s widened to floats (exact: every int8 is a float). Spelled out per ISA: GCC lowers the
// vector conversion from int8 lanes to floats element by element.
inline Vec16 load16(const int8_t* p) {
  Vec16 out;
#if defined(__AVX512F__)
  const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  std::memcpy(&out, &v, sizeof(out));
#elif defined(__AVX2__)
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
  std::memcpy(&out, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&out) + 32, &hi, 32);
#elif defined(__SSE4_1__)
  for (int i = 0; i < 4; ++i) {
    int32_t four;
    std::memcpy(&four, p + 4 * i, 4);
    const __m128 v = _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(four)));
    std::memcpy(reinterpret_cast<char*>(&out) + 16 * i, &v, 16);
  }
#elif defined(__aarch64__)
  const int8x16_t b = vld1q_s8(p);
  const int16x8_t lo = vmovl_s8(vget_low_s8(b)), hi = vmovl_high_s8(b);
  const float32x4_t parts[4] = {vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), vcvtq_f32_s32(vmovl_high_s16(lo)),
                                vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), vcvtq_f32_s32(vmovl_high_s16(hi))};
  std::memcpy(&out, parts, sizeof(out));
#else
  for (int i = 0; i < 16; ++i) out[i] = static_cast<float>(p[i]);
#endif
  return out;
}

// Sixteen float16 values (int4's scales, float16 activations) as floats: F16C or NEON where the build has
// them, else c10's conversion value by value.
inline Vec16 load16(const c10::Half* p) {
#if defined(__AVX512F__)
  const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  Vec16 out;
  std::memcpy(&out, &v, sizeof(out));
  return out;
#elif defined(__F16C__)
  const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  Vec16 out;
  std::memcpy(&out, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&out) + 32, &hi, 32);
  return out;
#elif defined(__aarch64__)
  typedef __fp16 F16x16 __attribute__((vector_size(32)));
  F16x16 h;
  std::memcpy(&h, p, sizeof(h));
  return __builtin_convertvector(h, Vec16);
#else
  Vec16 out;
  for (int i = 0; i < 16; ++i) out[i] = static_cast<float>(p[i]);
  return out;
#endif
}

inline void store16(float* p, Vec16 v) { std::memcpy(p, &v, sizeof(v)); }

inline void store16(c10::BFloat16* p, Vec16 v) {   // round_to<c10::BFloat16>, 16 lanes at once
  U32x16 u;
  std::memcpy(&u, &v, sizeof(u));
  U32x16 rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  rounded = (v != v) ? U32x16{} + 0x7FC0u : rounded;
  const U16x16 h = __builtin_convertvector(rounded, U16x16);
  std::memcpy(p, &h, sizeof(h));
}

inline void store16(c10::Half* p, Vec16 v) {
  for (int i = 0; i < 16; ++i) p[i] = static_cast<c10::Half>(v[i]);
}

// Sixteen bf16 pairs (64 bytes: column c's inputs 2j and 2j + 1 in 32-bit lane c) as two float vectors:
// the even inputs (the low halves, shifted up) and the odd ones (the high halves, the low bits cleared).
inline void load_bf16_pairs(const c10::BFloat16* p, Vec16& even, Vec16& odd) {
  U32x16 u;
  std::memcpy(&u, p, sizeof(u));
  const U32x16 lo = u << 16, hi = u & 0xFFFF0000u;
  std::memcpy(&even, &lo, sizeof(even));
  std::memcpy(&odd, &hi, sizeof(odd));
}

// The lane sums of eight vectors side by side, each by the same fixed tree (halves, quarters,
// eighths, pairs): 7 vector adds instead of 120 scalar ones.
inline Vec8 sum_lanes8(const Vec16 (&a)[8]) {
  Vec16 u[4], v[2];
  for (int i = 0; i < 4; ++i)
    u[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    v[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(u[2 * i], u[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const Vec16 w = __builtin_shufflevector(v[0], v[1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                  __builtin_shufflevector(v[0], v[1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(w, w, 0, 2, 4, 6, 8, 10, 12, 14) + __builtin_shufflevector(w, w, 1, 3, 5, 7, 9, 11, 13, 15);
}

// e^x to about 1 ulp for x in [-87, 88] (clamped there): Cephes' range reduction and polynomial,
// written so that the compiler vectorizes a loop of it (libm's expf is a call per element).
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  const float z = r * r;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

// While alive, the thread treats subnormal floats as zero, restored after. For loops of fast_exp: the
// compiler evaluates the clamped ends of its range for every element and keeps what applies, and SiLU's
// x / (1 + e^88) there is subnormal: on x86 each such vector took a microcode assist, many times the
// loop's own time. x86: MXCSR's FTZ and DAZ; aarch64: FPCR's FZ; elsewhere nothing to do.
struct FlushSubnormals {
#if TANDEM_X86
  const unsigned saved = _mm_getcsr();
  FlushSubnormals() { _mm_setcsr(saved | 0x8040); }
  ~FlushSubnormals() { _mm_setcsr(saved); }
#elif defined(__aarch64__)
  uint64_t saved;
  FlushSubnormals() {
    asm volatile("mrs %0, fpcr" : "=r"(saved));
    asm volatile("msr fpcr, %0" : : "r"(saved | (uint64_t{1} << 24)));
  }
  ~FlushSubnormals() { asm volatile("msr fpcr, %0" : : "r"(saved)); }
#endif
};

// A softmax's numerators in place: row[j] = e^((row[j] - max) * scale) for j < n; returns their sum
// (callers divide by it where it suits them).
inline float exp_shifted(float* row, int64_t n, float scale) {
  float top = -INFINITY;
  for (int64_t j = 0; j < n; ++j) top = std::max(top, row[j]);
  float total = 0.f;
_Pragma("omp simd reduction(+ : total)")
  for (int64_t j = 0; j < n; ++j) {
    row[j] = fast_exp((row[j] - top) * scale);
    total += row[j];
  }
  return total;
}

}  // namespace tandem
