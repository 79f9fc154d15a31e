#include "quantized.h"

#include "amx.h"

namespace tandem {

bool is_w8a8_packed(const at::Tensor& w) {
  return w.dim() == 5 && w.size(2) == 16 && w.size(3) == 16 && w.size(4) == 4 && w.scalar_type() == at::kChar;
}

bool is_int4_packed(const at::Tensor& w, const at::Tensor& scale) {
  return w.scalar_type() == at::kByte && w.dim() == 4 && w.size(2) == 4 && w.size(3) == 64 &&
         scale.scalar_type() == at::kHalf && scale.dim() == 3 && scale.size(0) == w.size(0) &&
         scale.size(1) == w.size(1) && scale.size(2) == TILE_COLS;
}

// ---- rows quantized ---------------------------------------------------------------------------------

// x[0, n) as int8 q: q = round(x * (127 / top)) half to even (as torch.round), top = max |x| (at least
// 1e-12); returns the scale top / 127. A multiply by the reciprocal, not a division per value.
template <typename T>
float quantize_span(const T* x, int64_t n, int8_t* q) {
  float amax = 0.f;
_Pragma("omp simd reduction(max : amax)")
  for (int64_t j = 0; j < n; ++j) amax = std::max(amax, std::fabs(to_float(x[j])));
  const float top = std::max(amax, 1e-12f), inv = 127.f / top;
_Pragma("omp simd")
  for (int64_t j = 0; j < n; ++j) {
    const float v = std::nearbyint(to_float(x[j]) * inv);      // |v| <= 127 already
    q[j] = static_cast<int8_t>(static_cast<int32_t>(std::min(127.f, std::max(-127.f, v))));
  }
  return top / 127.f;
}

// The rows of x as the format reads them, into `b` (row r: q [r * k_padded ..], zeros past k_dim; W8A8 one
// scale a row, int4 one scale and one sum of q per group of INT4_GROUP).
template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k_dim, const Weight& w, RowBuffers& b, bool alone) {
  const int64_t kp = w.k_padded, groups = kp / INT4_GROUP;
  const bool int4 = w.format == Format::Int4;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(k_dim, 1));   // threads for prompts only
  row_loop(rows, grain, alone, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int8_t* q = b.q.data() + r * kp;
      std::memset(q + k_dim, 0, kp - k_dim);
      if (!int4) {
        b.scales[r] = quantize_span(x + r * k_dim, k_dim, q);
        continue;
      }
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t from = g * INT4_GROUP, n = std::max<int64_t>(0, std::min(INT4_GROUP, k_dim - from));
        b.scales[r * groups + g] = quantize_span(x + r * k_dim + from, n, q + from);
        int32_t sum = 0;
        for (int64_t j = 0; j < INT4_GROUP; ++j) sum += q[from + j];
        b.sums[r * groups + g] = sum;
      }
    }
  });
}

// ---- W8A8's int32 sums ------------------------------------------------------------------------------

constexpr int64_t W8_BLOCK = TILE_COLS * W8_K;    // int8s of a block's 64 inputs

// The portable integer sums, on 64-byte vectors of 16-bit lanes that any SIMD build handles well (GCC lowers
// shifts, multiplies and adds of them; it lowers int8 lane conversions element by element). A lane holds two
// bytes of a block row: column c's inputs 2h, 2h + 1 of a quad in lane 2c + h. The products of a lane's
// two bytes by their inputs, added, fit int16 (at most 2 x 127 x 127); adding the lane pairs (2c, 2c + 1)
// gives column c's quad in 32 bits.
// A quad of x repeated for 16 columns: `even` holds its inputs 0 and 2 in alternate lanes, `odd` 1 and 3.
inline void quad_lanes(const int8_t* x, I16x32& even, I16x32& odd) {
  const int32_t e = static_cast<uint16_t>(int16_t{x[0]}) | (int32_t{x[2]} << 16);
  const int32_t o = static_cast<uint16_t>(int16_t{x[1]}) | (int32_t{x[3]} << 16);
  even = bits_as<I16x32>(splat<int32_t>(e));
  odd = bits_as<I16x32>(splat<int32_t>(o));
}

// Column c's sum of lanes 2c and 2c + 1.
inline I32x16 lane_pairs(I16x32 v) {
  const I32x16 w = bits_as<I32x16>(v);
  return ((w << 16) >> 16) + (w >> 16);
}

template <int R>
void w8_portable_rows(const int8_t* xq, int64_t k_padded, const int8_t* w, int32_t* c) {
  I32x16 acc[R] = {};
  for (int64_t kb = 0; kb < k_padded / W8_K; ++kb)
    for (int p = 0; p < W8_K / 4; ++p) {
      const I16x32 v = load_wide<int16_t>(w + kb * W8_BLOCK + p * 4 * TILE_COLS);
      const I16x32 even = (v << 8) >> 8, odd = v >> 8;          // the signed bytes, sign-extended
      for (int r = 0; r < R; ++r) {
        I16x32 xe, xo;
        quad_lanes(xq + r * k_padded + kb * W8_K + 4 * p, xe, xo);
        acc[r] += lane_pairs(even * xe + odd * xo);
      }
    }
  for (int r = 0; r < R; ++r) store_wide(c + r * GROUP_COLS, acc[r]);
}

template <int NB>
void w8_portable_pass(const int8_t* xq, int64_t m, int64_t k_padded, const int8_t* w, int32_t* c) {
  const int64_t column_stride = k_padded / W8_K * W8_BLOCK;
  for (int nb = 0; nb < NB; ++nb)
    in_row_runs<4>(m, [&](auto rows, int64_t r) {
      w8_portable_rows<decltype(rows)::value>(xq + r * k_padded, k_padded, w + nb * column_stride,
                                              c + r * GROUP_COLS + nb * TILE_COLS);
    });
}

// AVX512-VNNI: vpdpbusd sums four products of unsigned by signed bytes into each int32 lane, and a packed
// block's 64 bytes [p][c][e] are the four inputs 4p .. 4p + 3 of its 16 columns, the lanes' order. x is
// signed, so it enters as x + 128 (x ^ 0x80) and the pass takes 128 x each column's sum of W off again,
// which the first rows' pass adds up with the same instruction on a vector of ones: the same exact sums as
// the plain loop (at most 255 x 128 x K in a lane). Each 64-byte vector of W is loaded once for R rows.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool HAS_VNNI = true;

template <int NB, int R, bool SUM_COLUMNS>
void w8_vnni_rows(const int8_t* xq, int64_t k_padded, const int8_t* w, int64_t column_stride, __m512i (&offset)[NB],
                  int32_t* c) {
  __m512i acc[R][NB], column_sum[NB];
  for (int nb = 0; nb < NB; ++nb) {
    column_sum[nb] = _mm512_setzero_si512();
    for (int r = 0; r < R; ++r) acc[r][nb] = _mm512_setzero_si512();
  }
  const __m512i ones = _mm512_set1_epi8(1);
  const int64_t ahead = weight_fetch_ahead();
  for (int64_t kb = 0; kb < k_padded / W8_K; ++kb)
    for (int p = 0; p < W8_K / 4; ++p) {
      const int8_t* wk = w + kb * W8_BLOCK + p * 4 * TILE_COLS;
      for (int nb = 0; nb < NB; ++nb) fetch_weights(wk + nb * column_stride, ahead, 64);
      __m512i b[NB];
      for (int nb = 0; nb < NB; ++nb) b[nb] = _mm512_loadu_si512(wk + nb * column_stride);
      if constexpr (SUM_COLUMNS)
        for (int nb = 0; nb < NB; ++nb) column_sum[nb] = _mm512_dpbusd_epi32(column_sum[nb], ones, b[nb]);
      for (int r = 0; r < R; ++r) {
        uint32_t four;
        std::memcpy(&four, xq + r * k_padded + kb * W8_K + 4 * p, 4);
        const __m512i a = _mm512_set1_epi32(static_cast<int>(four ^ 0x80808080u));
        for (int nb = 0; nb < NB; ++nb) acc[r][nb] = _mm512_dpbusd_epi32(acc[r][nb], a, b[nb]);
      }
    }
  if constexpr (SUM_COLUMNS)
    for (int nb = 0; nb < NB; ++nb) offset[nb] = _mm512_slli_epi32(column_sum[nb], 7);
  for (int r = 0; r < R; ++r)
    for (int nb = 0; nb < NB; ++nb)
      _mm512_storeu_si512(c + r * GROUP_COLS + nb * TILE_COLS, _mm512_sub_epi32(acc[r][nb], offset[nb]));
}

template <int NB>
void w8_vnni_pass(const int8_t* xq, int64_t m, int64_t k_padded, const int8_t* w, int32_t* c) {
  const int64_t column_stride = k_padded / W8_K * W8_BLOCK;
  for (int nb = 0; nb < NB; ++nb) {                 // block by block: one sequential stream of weights
    __m512i offset[1];
    in_row_runs<MAX_RUN>(m, [&](auto rows, int64_t r) {
      constexpr int R = decltype(rows)::value;
      const int8_t* wb = w + nb * column_stride;
      int32_t* cb = c + r * GROUP_COLS + nb * TILE_COLS;
      if (r == 0) w8_vnni_rows<1, R, true>(xq, k_padded, wb, column_stride, offset, cb);
      else w8_vnni_rows<1, R, false>(xq + r * k_padded, k_padded, wb, column_stride, offset, cb);
    });
  }
}
#else
constexpr bool HAS_VNNI = false;
#endif

// AVX2: vpmaddubsw multiplies unsigned by signed bytes and adds adjacent pairs into int16 lanes, which
// saturate; with |x| as the unsigned side and W with x's sign as the signed one (vpsignb), a pair is at
// most 2 x 127 x 127 and fits, so the sums stay exact. vpmaddwd by ones then adds the pairs of a quad into
// the column's int32 lane. One block (16 columns, two registers) for up to four rows at a time.
#if defined(__AVX2__)
constexpr bool HAS_AVX2_INT8 = true;

template <int R>
void w8_avx2_rows(const int8_t* xq, int64_t k_padded, const int8_t* w, int32_t* c) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  const int64_t ahead = weight_fetch_ahead();
  for (int64_t kb = 0; kb < k_padded / W8_K; ++kb)
    for (int p = 0; p < W8_K / 4; ++p) {
      const int8_t* wk = w + kb * W8_BLOCK + p * 4 * TILE_COLS;
      fetch_weights(wk, ahead, 64);
      const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk));
      const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + 32));
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xq + r * k_padded + kb * W8_K + 4 * p, 4);
        const __m256i a = _mm256_set1_epi32(four), magnitude = _mm256_abs_epi8(a);
        acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(b0, a)), ones));
        acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(b1, a)), ones));
      }
    }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + r * GROUP_COLS), acc[r][0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + r * GROUP_COLS + 8), acc[r][1]);
  }
}

template <int NB>
void w8_avx2_pass(const int8_t* xq, int64_t m, int64_t k_padded, const int8_t* w, int32_t* c) {
  const int64_t column_stride = k_padded / W8_K * W8_BLOCK;
  for (int nb = 0; nb < NB; ++nb)
    in_row_runs<4>(m, [&](auto rows, int64_t r) {
      w8_avx2_rows<decltype(rows)::value>(xq + r * k_padded, k_padded, w + nb * column_stride,
                                          c + r * GROUP_COLS + nb * TILE_COLS);
    });
}
#else
constexpr bool HAS_AVX2_INT8 = false;
#endif

constexpr bool HAS_W8A8_TILES = HAS_TILE_PRODUCT && HAS_INT8_TILES;
bool w8a8_tiles() { return HAS_W8A8_TILES && tuning().isa_products && tiles_granted(); }
bool vnni() { return HAS_VNNI && tuning().isa_products; }
bool avx2_int8() { return HAS_AVX2_INT8 && tuning().isa_products; }

// out[j] = float(sums[j]) * row_scale * w_scale[j] (+ bias[j]), rounded to T: the reference's operations in
// its order, each rounded to float32 (no multiply-add fused: it would skip a rounding), so the two agree bit
// for bit.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void store_w8a8_row(T* out, const int32_t* sums, float row_scale,
                                                                 const float* w_scale, const T* bias, int64_t width) {
  for (int64_t j = 0; j < width; ++j) {
    const float v = static_cast<float>(sums[j]) * row_scale * w_scale[j];
    out[j] = round_to<T>(bias ? v + to_float(bias[j]) : v);
  }
}

template <typename T>
struct W8A8Ops : NoSetup {
  const int8_t* xq;
  const float* xs;
  const Weight* w;
  T* y;
  bool tiles = false;

  void setup(int64_t m) {
    if (tiles) tile_config(m);
  }
  void done() {
    if (tiles) tile_release();
  }

  template <typename Blocks>
  void pass(Blocks, int64_t m0, int64_t m, int64_t first, int32_t* c) const {
    constexpr int NB = Blocks::value;
    const int64_t kp = w->k_padded;
    const int8_t* wp = w->data.data_ptr<int8_t>();
    const int8_t* x = xq + m0 * kp;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
    if (tiles) return tile_pass<Int8Tiles, NB>(x, kp, wp, first, c);
#endif
    const int8_t* wb = wp + first * kp * TILE_COLS;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (vnni()) return w8_vnni_pass<NB>(x, m, kp, wb, c);
#endif
#if defined(__AVX2__)
    if (avx2_int8()) return w8_avx2_pass<NB>(x, m, kp, wb, c);
#endif
    w8_portable_pass<NB>(x, m, kp, wb, c);
  }

  void store(int64_t m0, int64_t m, int64_t first, int64_t nb, const int32_t* c) const {
    const int64_t n0 = first * TILE_COLS, width = std::min(nb * TILE_COLS, w->n_dim - n0);
    const T* bias = w->bias.defined() ? w->bias.data_ptr<T>() + n0 : nullptr;
    for (int64_t r = 0; r < m; ++r)
      store_w8a8_row(y + (m0 + r) * w->n_dim + n0, c + r * GROUP_COLS, xs[m0 + r], w->scale.data_ptr<float>() + n0,
                     bias, width);
  }
};

// ---- int4's sums ------------------------------------------------------------------------------------

constexpr int64_t INT4_BYTES = TILE_COLS * INT4_GROUP / 2;    // a block's group: 16 columns x 32 inputs

// The int32 sums s[r][c] = sum over a group's 32 inputs of (w + 8) * x for R rows of quantized x (rows
// `stride` apart, at the group's first input) against one block's group `wg`: chunk j of 64 bytes holds
// inputs 8j .. 8j + 3 of the 16 columns in its low nibbles (byte 4c + e: column c, input 8j + e) and inputs
// 8j + 4 .. 8j + 7 in its high ones.
// Portable: the 16-bit lanes of the chunk's bytes (quantized.cpp's W8A8 pass has the lane layout), the low
// nibbles the quad 8j .. 8j + 3, the high ones 8j + 4 .. 8j + 7; a lane's products (at most 2 x 15 x 127 a
// quad) add up over a group's eight quads within int16, the lane pairs into int32 at the end.
template <int R>
void int4_sums_portable(const uint8_t* wg, const int8_t* x, int64_t stride, int32_t (*s)[TILE_COLS]) {
  I16x32 acc[R] = {};
  for (int j = 0; j < 4; ++j) {
    const U16x32 v = load_wide<uint16_t>(wg + j * 64);
    const I16x32 lo_even = bits_as<I16x32>(v & 15), lo_odd = bits_as<I16x32>((v >> 8) & 15);
    const I16x32 hi_even = bits_as<I16x32>((v >> 4) & 15), hi_odd = bits_as<I16x32>(v >> 12);
    for (int r = 0; r < R; ++r) {
      I16x32 ae, ao, be, bo;
      quad_lanes(x + r * stride + 8 * j, ae, ao);
      quad_lanes(x + r * stride + 8 * j + 4, be, bo);
      acc[r] += lo_even * ae + lo_odd * ao + hi_even * be + hi_odd * bo;
    }
  }
  for (int r = 0; r < R; ++r) {
    const I32x16 sums = lane_pairs(acc[r]);
    store_wide(s[r], sums);
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// vpdpbusd: the weights (0 .. 15) as the unsigned side, x as the signed, four products a lane.
template <int R>
void int4_sums_vnni(const uint8_t* wg, const int8_t* x, int64_t stride, int32_t (*s)[TILE_COLS]) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  __m512i acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
  for (int j = 0; j < 4; ++j) {
    const __m512i v = _mm512_loadu_si512(wg + j * 64);
    const __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
    for (int r = 0; r < R; ++r) {
      int32_t a, b;
      std::memcpy(&a, x + r * stride + 8 * j, 4);
      std::memcpy(&b, x + r * stride + 8 * j + 4, 4);
      acc[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[r], lo, _mm512_set1_epi32(a)), hi, _mm512_set1_epi32(b));
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_si512(s[r], acc[r]);
}
#endif

#if defined(__AVX2__)
// vpmaddubsw: the weights (0 .. 15) as the unsigned side, so a pair is at most 2 x 15 x 127 and a group's
// eight chunks' pairs add up in int16 without saturating; vpmaddwd by ones adds each column's pairs once.
template <int R>
void int4_sums_avx2(const uint8_t* wg, const int8_t* x, int64_t stride, int32_t (*s)[TILE_COLS]) {
  const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256i acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + j * 64));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + j * 64 + 32));
    const __m256i lo0 = _mm256_and_si256(v0, mask), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), mask);
    const __m256i lo1 = _mm256_and_si256(v1, mask), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), mask);
    for (int r = 0; r < R; ++r) {
      int32_t a4, b4;
      std::memcpy(&a4, x + r * stride + 8 * j, 4);
      std::memcpy(&b4, x + r * stride + 8 * j + 4, 4);
      const __m256i a = _mm256_set1_epi32(a4), b = _mm256_set1_epi32(b4);
      acc[r][0] = _mm256_add_epi16(acc[r][0], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, a), _mm256_maddubs_epi16(hi0, b)));
      acc[r][1] = _mm256_add_epi16(acc[r][1], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, a), _mm256_maddubs_epi16(hi1, b)));
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(s[r]), _mm256_madd_epi16(acc[r][0], ones));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(s[r] + 8), _mm256_madd_epi16(acc[r][1], ones));
  }
}
#endif

// The float sums of R rows against one block, over every group in order: c[r] += float(s - 8 * sum(x)) *
// (w_scale * x_scale), the same portable arithmetic whichever instructions took the integer sums.
template <int R>
void int4_rows(const int8_t* xq, const float* xs, const int32_t* xsum, int64_t k_padded, const uint8_t* w,
               const c10::Half* w_scale, float* c) {
  const int64_t groups = k_padded / INT4_GROUP;
  Vec16 acc[R] = {};
  alignas(64) int32_t s[R][TILE_COLS];
  const bool use_vnni = vnni(), use_avx2 = avx2_int8();    // once, not per group: each reads the tuning record
  (void)use_vnni, (void)use_avx2;                          // a build without either path reads neither
  const int64_t ahead = weight_fetch_ahead();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = w + g * INT4_BYTES;
    const int8_t* xg = xq + g * INT4_GROUP;
    fetch_weights(wg, ahead, INT4_BYTES);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (use_vnni) int4_sums_vnni<R>(wg, xg, k_padded, s);
    else
#endif
#if defined(__AVX2__)
    if (use_avx2) int4_sums_avx2<R>(wg, xg, k_padded, s);
    else
#endif
      int4_sums_portable<R>(wg, xg, k_padded, s);
    const Vec16 ws = load16(w_scale + g * TILE_COLS);
    for (int r = 0; r < R; ++r) {
      const I32x16 si = load_wide<int32_t>(s[r]) - 8 * xsum[r * groups + g];
      acc[r] += convert<float>(si) * (ws * xs[r * groups + g]);
    }
  }
  for (int r = 0; r < R; ++r) store16(c + r * GROUP_COLS, acc[r]);
}

// Rows an int4 run takes: its int16 sums and float sums of each row stay in registers beside the chunk's
// nibbles, which AVX2's sixteen registers hold for four rows.
constexpr int INT4_RUN = VEC16_REGISTERS >= 32 ? 8 : 4;

template <typename T>
struct Int4Ops : NoSetup {
  const RowBuffers* rows;
  const Weight* w;
  T* y;

  template <typename Blocks>
  void pass(Blocks, int64_t m0, int64_t m, int64_t first, float* c) const {
    const int64_t kp = w->k_padded, groups = kp / INT4_GROUP;
    const uint8_t* wp = w->data.data_ptr<uint8_t>();
    const c10::Half* sp = w->scale.data_ptr<c10::Half>();
    for (int nb = 0; nb < Blocks::value; ++nb) {
      const int64_t block = first + nb;
      in_row_runs<INT4_RUN>(m, [&](auto run, int64_t r) {
        const int64_t row = m0 + r;
        int4_rows<decltype(run)::value>(rows->q.data() + row * kp, rows->scales.data() + row * groups,
                                        rows->sums.data() + row * groups, kp, wp + block * groups * INT4_BYTES,
                                        sp + block * groups * TILE_COLS, c + r * GROUP_COLS + nb * TILE_COLS);
      });
    }
  }

  void store(int64_t m0, int64_t m, int64_t first, int64_t nb, const float* c) const {
    const int64_t n0 = first * TILE_COLS, width = nb * TILE_COLS;
    const T* bias = w->bias.defined() ? w->bias.data_ptr<T>() + n0 : nullptr;
    for (int64_t r = 0; r < m; ++r) {
      T* out = y + (m0 + r) * w->n_dim + n0;
      for (int64_t j = 0; j < width; j += 16) {
        Vec16 v = load16(c + r * GROUP_COLS + j);
        if (bias) v += load16(bias + j);
        store16(out + j, v);
      }
    }
  }
};

template <typename T>
void quantized_product_into(const T* x, int64_t rows, int64_t k_dim, const Weight& w, RowBuffers& buffers, T* y,
                            bool alone, const Weight* next) {
  quantize_rows(x, rows, k_dim, w, buffers, alone);
  if (w.format == Format::Int4) {
    Int4Ops<T> ops;
    ops.rows = &buffers;
    ops.w = &w;
    ops.y = y;
    return blocked_product<float>(rows, w.blocks, ops, next);
  }
  W8A8Ops<T> ops;
  ops.xq = buffers.q.data();
  ops.xs = buffers.scales.data();
  ops.w = &w;
  ops.y = y;
  ops.tiles = w8a8_tiles();
  blocked_product<int32_t>(rows, w.blocks, ops, next);
}

template void quantized_product_into<float>(const float*, int64_t, int64_t, const Weight&, RowBuffers&, float*, bool,
                                            const Weight*);
template void quantized_product_into<c10::BFloat16>(const c10::BFloat16*, int64_t, int64_t, const Weight&,
                                                    RowBuffers&, c10::BFloat16*, bool, const Weight*);
template void quantized_product_into<c10::Half>(const c10::Half*, int64_t, int64_t, const Weight&, RowBuffers&,
                                                c10::Half*, bool, const Weight*);

std::string quantized_path(Format format) {
  if (format == Format::W8A8 && w8a8_tiles()) return "AMX int8 tiles";
  if (vnni()) return "AVX512-VNNI";
  if (avx2_int8()) return "AVX2";
  return "portable vectors";
}

std::tuple<at::Tensor, at::Tensor> quantize_rows_w8a8(const at::Tensor& x_in) {
  check_cpu_rows(x_in, "x");
  const auto x = x_in.contiguous();
  const int64_t rows = x.size(0), k = x.size(1);
  auto q = empty({rows, k}, x.options().dtype(at::kChar));
  auto s = empty({rows}, x.options().dtype(at::kFloat));
  TANDEM_DISPATCH(x.scalar_type(), "quantize_rows", [&] {
    for (int64_t r = 0; r < rows; ++r)
      s.data_ptr<float>()[r] = quantize_span(x.data_ptr<scalar_t>() + r * k, k, q.data_ptr<int8_t>() + r * k);
  });
  return {q, s};
}

}  // namespace tandem
