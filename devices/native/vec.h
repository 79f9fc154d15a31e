// The portable vector layer every kernel is written over: 64 bytes of lanes (16 floats, 16 int32s, 32
// int16s) as Wide<T>, the native GCC/Clang vectors of the build side by side (one AVX-512 register, two
// AVX2 ones, four SSE or NEON ones), so the same source runs on every CPU the build targets
// (devices/cpu_native.py picks the level: x86-64-v2, -v3, -v4 or the machine's own). What the build has is
// known here at compile time (the ISA constants below); x86 intrinsics appear only under their feature
// macros: here for conversions GCC's vectors spell badly, and in the products that pay for them
// (products.cpp, quantized.cpp, amx.h), each with a portable path beside it.
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

// 64 bytes of T as the registers of the build hold them: one AVX-512 register, two AVX2 ones, four SSE or
// NEON ones, each a native GCC vector, the operators applied part by part. (GCC's own 64-byte vector types
// on a 32- or 16-byte target keep their values in memory between operations: a product's sums spilled on
// every multiply-add.)
template <typename T>
struct Wide {
  typedef T Native __attribute__((vector_size(VECTOR_BYTES)));
  // A native vector read or written at any address, through any type (as the intrinsics' unaligned types).
  typedef T Unaligned __attribute__((vector_size(VECTOR_BYTES), aligned(1), may_alias));
  using Scalar = T;
  static constexpr int PARTS = 64 / VECTOR_BYTES;
  static constexpr int LANES = VECTOR_BYTES / static_cast<int>(sizeof(T));   // lanes of a part
  Native part[PARTS];

  T operator[](int i) const { return part[i / LANES][i % LANES]; }
};

using Vec16 = Wide<float>;
using I32x16 = Wide<int32_t>;
using U32x16 = Wide<uint32_t>;
using I16x32 = Wide<int16_t>;
using U16x32 = Wide<uint16_t>;

#define TANDEM_WIDE_OP(op)                                                                            \
  template <typename T>                                                                               \
  inline Wide<T> operator op(Wide<T> a, const Wide<T>& b) {                                           \
    for (int i = 0; i < Wide<T>::PARTS; ++i) a.part[i] = a.part[i] op b.part[i];                      \
    return a;                                                                                         \
  }                                                                                                   \
  template <typename T>                                                                               \
  inline Wide<T> operator op(Wide<T> a, typename Wide<T>::Scalar b) {                                 \
    for (int i = 0; i < Wide<T>::PARTS; ++i) a.part[i] = a.part[i] op b;                              \
    return a;                                                                                         \
  }                                                                                                   \
  template <typename T>                                                                               \
  inline Wide<T>& operator op##=(Wide<T>& a, const Wide<T>& b) {                                      \
    for (int i = 0; i < Wide<T>::PARTS; ++i) a.part[i] = a.part[i] op b.part[i];                      \
    return a;                                                                                         \
  }
TANDEM_WIDE_OP(+)
TANDEM_WIDE_OP(-)
TANDEM_WIDE_OP(*)
TANDEM_WIDE_OP(&)
#undef TANDEM_WIDE_OP

template <typename T>
inline Wide<T> operator>>(Wide<T> a, int n) {
  for (int i = 0; i < Wide<T>::PARTS; ++i) a.part[i] = a.part[i] >> n;
  return a;
}
template <typename T>
inline Wide<T> operator<<(Wide<T> a, int n) {
  for (int i = 0; i < Wide<T>::PARTS; ++i) a.part[i] = a.part[i] << n;
  return a;
}

// x in every lane (x - 0 is x for every float, so the compiler drops the subtraction: one broadcast).
template <typename T = float>
inline Wide<T> splat(T x) {
  Wide<T> w;
  for (int i = 0; i < Wide<T>::PARTS; ++i) w.part[i] = x - typename Wide<T>::Native{};
  return w;
}

template <typename T = float>
inline Wide<T> zero() {
  Wide<T> w;
  for (int i = 0; i < Wide<T>::PARTS; ++i) w.part[i] = typename Wide<T>::Native{};
  return w;
}

// The same 64 bytes read as another lane type.
template <typename To, typename T>
inline To bits_as(const Wide<T>& v) {
  To out;
  for (int i = 0; i < Wide<T>::PARTS; ++i) out.part[i] = (typename To::Native)v.part[i];   // a vector cast: the bits
  return out;
}

// 64 bytes at p (any alignment) as Wide<T>, and back.
template <typename T>
inline Wide<T> load_wide(const void* p) {
  Wide<T> w;
  for (int i = 0; i < Wide<T>::PARTS; ++i)
    w.part[i] = *reinterpret_cast<const typename Wide<T>::Unaligned*>(static_cast<const char*>(p) + i * VECTOR_BYTES);
  return w;
}

template <typename T>
inline void store_wide(void* p, const Wide<T>& w) {
  for (int i = 0; i < Wide<T>::PARTS; ++i)
    *reinterpret_cast<typename Wide<T>::Unaligned*>(static_cast<char*>(p) + i * VECTOR_BYTES) = w.part[i];
}

// Lane by lane into U (the same number of lanes: int32 <-> float).
template <typename U, typename T>
inline Wide<U> convert(const Wide<T>& a) {
  static_assert(sizeof(U) == sizeof(T));
  Wide<U> out;
  for (int i = 0; i < Wide<T>::PARTS; ++i) out.part[i] = __builtin_convertvector(a.part[i], typename Wide<U>::Native);
  return out;
}

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

inline Vec16 load16(const float* p) { return load_wide<float>(p); }

// Half a part of uint16 lanes, widened into a part of uint32 lanes.
typedef uint16_t U16Half __attribute__((vector_size(VECTOR_BYTES / 2)));

inline Vec16 load16(const c10::BFloat16* p) {      // bf16 is the top half of a float32
  U32x16 w;
  for (int i = 0; i < U32x16::PARTS; ++i) {
    U16Half h;
    std::memcpy(&h, reinterpret_cast<const char*>(p) + i * VECTOR_BYTES / 2, sizeof(h));
    w.part[i] = __builtin_convertvector(h, U32x16::Native) << 16;
  }
  return bits_as<Vec16>(w);
}

// Sixteen int8s widened to floats (exact: every int8 is a float). Spelled out per ISA: GCC lowers the
// vector conversion from int8 lanes to floats element by element.
inline Vec16 load16(const int8_t* p) {
  Vec16 out;
#if defined(__AVX512F__)
  out.part[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  out.part[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  out.part[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
#elif defined(__SSE4_1__)
  for (int i = 0; i < 4; ++i) {
    int32_t four;
    std::memcpy(&four, p + 4 * i, 4);
    out.part[i] = _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(four)));
  }
#elif defined(__aarch64__)
  const int8x16_t b = vld1q_s8(p);
  const int16x8_t lo = vmovl_s8(vget_low_s8(b)), hi = vmovl_high_s8(b);
  out.part[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo)));
  out.part[1] = vcvtq_f32_s32(vmovl_high_s16(lo));
  out.part[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi)));
  out.part[3] = vcvtq_f32_s32(vmovl_high_s16(hi));
#else
  float values[16];
  for (int i = 0; i < 16; ++i) values[i] = static_cast<float>(p[i]);
  out = load16(values);
#endif
  return out;
}

// Sixteen float16 values (int4's scales, float16 activations) as floats: F16C or NEON where the build has
// them, else c10's conversion value by value.
inline Vec16 load16(const c10::Half* p) {
  Vec16 out;
#if defined(__AVX512F__)
  out.part[0] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  out.part[0] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  out.part[1] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
#elif defined(__aarch64__)
  for (int i = 0; i < 4; ++i) out.part[i] = vcvt_f32_f16(vld1_f16(reinterpret_cast<const __fp16*>(p) + 4 * i));
#else
  float values[16];
  for (int i = 0; i < 16; ++i) values[i] = static_cast<float>(p[i]);
  out = load16(values);
#endif
  return out;
}

inline void store16(float* p, const Vec16& v) { store_wide(p, v); }

inline void store16(c10::BFloat16* p, const Vec16& v) {   // round_to<c10::BFloat16>, 16 lanes at once
  for (int i = 0; i < Vec16::PARTS; ++i) {
    const U32x16::Native u = (U32x16::Native)v.part[i];
    U32x16::Native rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    const auto nan = v.part[i] != v.part[i];
    rounded = nan ? (U32x16::Native{} + 0x7FC0u) : rounded;
    const U16Half h = __builtin_convertvector(rounded, U16Half);
    std::memcpy(reinterpret_cast<char*>(p) + i * VECTOR_BYTES / 2, &h, sizeof(h));
  }
}

inline void store16(c10::Half* p, const Vec16& v) {
  for (int i = 0; i < 16; ++i) p[i] = static_cast<c10::Half>(v[i]);
}

// Sixteen bf16 pairs (64 bytes: column c's inputs 2j and 2j + 1 in 32-bit lane c) as two float vectors:
// the even inputs (the low halves, shifted up) and the odd ones (the high halves, the low bits cleared).
inline void load_bf16_pairs(const c10::BFloat16* p, Vec16& even, Vec16& odd) {
  const U32x16 u = load_wide<uint32_t>(p);
  even = bits_as<Vec16>(u << 16);
  odd = bits_as<Vec16>(u & 0xFFFF0000u);
}

// The lane sums of eight vectors side by side, out[k] the sum of a[k]'s 16 lanes: the parts of each added,
// then the eight registers reduced together by a fixed tree of shuffles (halves, quarters, ...): a few
// vector adds instead of 120 scalar ones.
template <typename V = Vec16>                  // a template, so that only its width's branch is compiled
inline void sum_lanes8(const V (&a)[8], float (&out)[8]) {
  using N = typename V::Native;
  N x[8];
  for (int k = 0; k < 8; ++k) {
    x[k] = a[k].part[0];
    for (int i = 1; i < V::PARTS; ++i) x[k] += a[k].part[i];
  }
  if constexpr (V::LANES == 16) {
    N u[4], v[2];
    for (int i = 0; i < 4; ++i)
      u[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
             __builtin_shufflevector(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 2; ++i)
      v[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
             __builtin_shufflevector(u[2 * i], u[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    const N w = __builtin_shufflevector(v[0], v[1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                __builtin_shufflevector(v[0], v[1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    for (int k = 0; k < 8; ++k) out[k] = w[2 * k] + w[2 * k + 1];
  } else if constexpr (V::LANES == 8) {
    N u[4], v[2];
    for (int i = 0; i < 4; ++i)
      u[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
             __builtin_shufflevector(x[2 * i], x[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; ++i)
      v[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
             __builtin_shufflevector(u[2 * i], u[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    const N w = __builtin_shufflevector(v[0], v[1], 0, 2, 4, 6, 8, 10, 12, 14) +
                __builtin_shufflevector(v[0], v[1], 1, 3, 5, 7, 9, 11, 13, 15);
    for (int k = 0; k < 8; ++k) out[k] = w[k];
  } else {
    static_assert(V::LANES == 4);
    N u[4], v[2];
    for (int i = 0; i < 4; ++i)
      u[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 4, 5) +
             __builtin_shufflevector(x[2 * i], x[2 * i + 1], 2, 3, 6, 7);
    for (int i = 0; i < 2; ++i)
      v[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 2, 4, 6) +
             __builtin_shufflevector(u[2 * i], u[2 * i + 1], 1, 3, 5, 7);
    for (int k = 0; k < 4; ++k) out[k] = v[0][k], out[4 + k] = v[1][k];
  }
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
