// The float formats' products (float32, bf16, weight-only int8) and the products' entry points; the
// formats with quantized rows (W8A8, int4) are in quantized.cpp. See products.h for the layouts.
#include "products.h"

#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/linear.h>

#include "amx.h"
#include "quantized.h"

namespace tandem {

// ---- the portable float passes -------------------------------------------------------------------

// A pass reads one column block at a time, front to back, for a run of rows (run_limit): the thread's weights
// are then one sequential stream, what the hardware prefetcher follows best when decoding reads them from
// memory, and a run of many rows still makes a weight vector's load one of several multiply-adds.

// How a block's inputs are read as float vectors of its 16 columns: UNIT inputs at a time, the block's
// elements for input k starting at k * 16 (so blocks lie k_dim * 16 elements apart in every format).
struct F32Blocks {
  using Elem = float;
  static constexpr int UNIT = 1;
  static void load(const float* w, int64_t k, Vec16* v) { v[0] = load16(w + k * TILE_COLS); }
};
struct Int8Blocks {          // exact: the scale is applied to the sums
  using Elem = int8_t;
  static constexpr int UNIT = 1;
  static void load(const int8_t* w, int64_t k, Vec16* v) { v[0] = load16(w + k * TILE_COLS); }
};
struct Bf16PairBlocks {      // inputs k, k + 1 of the 16 columns side by side (k even)
  using Elem = c10::BFloat16;
  static constexpr int UNIT = 2;
  static void load(const c10::BFloat16* w, int64_t k, Vec16* v) { load_bf16_pairs(w + k * TILE_COLS, v[0], v[1]); }
};

// The float sums of R rows of x (rows k_dim apart) against NB blocks from w (blocks k_dim * 16 elements
// apart) into c [R][GROUP_COLS]: each weight vector loaded once for the R rows, each column's sum its inputs
// in order, one multiply-add each, into CHAINS sums taken in turn input by input (added at the end: a
// chain of dependent multiply-adds a load of 16 int8 weights long was what held weight-only int8's decoding
// back), whatever R is, and whatever format the weight vector came from.
template <int R, int NB, typename B, int CHAINS>
void float_rows(const float* x, int64_t k_dim, const typename B::Elem* w, float* c) {
  const int64_t column_stride = k_dim * TILE_COLS;
  Vec16 acc[CHAINS][R][NB] = {};
  const int64_t ahead = weight_fetch_ahead();
  constexpr int64_t STEP_BYTES = B::UNIT * TILE_COLS * sizeof(typename B::Elem);    // int8: a quarter line
  int64_t k = 0;
  const auto step = [&](auto chain) {
    for (int nb = 0; nb < NB; ++nb) {
      if (STEP_BYTES >= 64 || (k * TILE_COLS * int64_t(sizeof(typename B::Elem))) % 64 == 0)
        fetch_weights(w + nb * column_stride + k * TILE_COLS, ahead, 64);
      Vec16 wv[B::UNIT];
      B::load(w + nb * column_stride, k, wv);
      for (int u = 0; u < B::UNIT; ++u)
        for (int r = 0; r < R; ++r) acc[chain][r][nb] += splat(x[r * k_dim + k + u]) * wv[u];
    }
    k += B::UNIT;
  };
  for (; k + CHAINS * B::UNIT <= k_dim;)
    [&]<int... I>(std::integer_sequence<int, I...>) { (step(I), ...); }(std::make_integer_sequence<int, CHAINS>{});
  for (int chain = 0; k < k_dim; chain = (chain + 1) % CHAINS) step(chain);
  for (int r = 0; r < R; ++r)
    for (int nb = 0; nb < NB; ++nb) {
      Vec16 sum = acc[0][r][nb];
      for (int chain = 1; chain < CHAINS; ++chain) sum += acc[chain][r][nb];
      store16(c + r * GROUP_COLS + nb * TILE_COLS, sum);
    }
}

// The float sums of rows [0, m) of x against the NB blocks at w, c [m][GROUP_COLS] (in_block_runs).
template <typename B, int NB, int CHAINS>
void float_pass(const float* x, int64_t m, int64_t k_dim, const typename B::Elem* w, float* c) {
  in_block_runs<NB, CHAINS>(m, [&](auto blocks, int nb, auto rows, int64_t r) {
    float_rows<decltype(rows)::value, decltype(blocks)::value, B, CHAINS>(
        x + r * k_dim, k_dim, w + nb * k_dim * TILE_COLS, c + r * GROUP_COLS + nb * TILE_COLS);
  });
}

// Each format's chains: weight-only int8 reads 16 bytes a multiply-add, so one chain a column would wait on
// the multiply-add's latency more than on memory; float32 reads 64, bf16 pairs 64 for two.
constexpr int INT8_CHAINS = 2;

// A group's blocks widened to float32 once for all the rows of a prompt chunk (the same values the pass
// widens vector by vector, so the same sums), in a buffer of the thread's own.
constexpr int64_t WIDEN_ROWS = 8;      // more rows than this: widen once (fewer: in registers, as read)
// int8 widens in registers in two instructions a vector, against a buffer's write and reads: once only
// pays for prompt-sized runs (docs/cpu-kernels.md: the tuning record's widen_once)
constexpr int64_t WIDEN_INT8_ROWS = 64;

template <typename B>
const float* widen_group(const typename B::Elem* w, int64_t nb, int64_t k_dim) {
  thread_local std::vector<float> widened;
  widened.resize(static_cast<size_t>(TILE_GROUP * k_dim * TILE_COLS));
  float* out = widened.data();
  for (int64_t i = 0; i < nb * k_dim; i += B::UNIT) {        // (block, input) pairs, UNIT inputs at a time
    Vec16 v[B::UNIT];
    B::load(w, i, v);
    for (int u = 0; u < B::UNIT; ++u) store16(out + (i + u) * TILE_COLS, v[u]);
  }
  return out;
}

// ---- bf16 pairs in hardware (x86) --------------------------------------------------------------------

#if defined(__AVX512BF16__)
constexpr bool HAS_AVX512_BF16 = true;

// A block's 64-byte row p is the input pair 2p, 2p + 1 of its 16 columns: one vdpbf16ps against that pair
// of x broadcast gives 16 output sums side by side. R rows against NB blocks: each weight vector is loaded
// once for R rows. A column's sum is its pairs in order, whatever rows are read with it.
template <int NB, int R>
void bf16_dot_rows(const c10::BFloat16* x, int64_t k_dim, const c10::BFloat16* w, float* c) {
  const int64_t column_stride = k_dim * TILE_COLS;
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int nb = 0; nb < NB; ++nb) acc[r][nb] = _mm512_setzero_ps();
  const int64_t ahead = weight_fetch_ahead();
  for (int64_t k = 0; k < k_dim; k += 2) {
    __m512bh b[NB];
    for (int nb = 0; nb < NB; ++nb) fetch_weights(w + nb * column_stride + k * TILE_COLS, ahead, 64);
    for (int nb = 0; nb < NB; ++nb) b[nb] = (__m512bh)_mm512_loadu_si512(w + nb * column_stride + k * TILE_COLS);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * k_dim + k, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int nb = 0; nb < NB; ++nb) acc[r][nb] = _mm512_dpbf16_ps(acc[r][nb], a, b[nb]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int nb = 0; nb < NB; ++nb) _mm512_storeu_ps(c + r * GROUP_COLS + nb * TILE_COLS, acc[r][nb]);
}

template <int NB>
void bf16_dot_pass(const c10::BFloat16* x, int64_t m, int64_t k_dim, const c10::BFloat16* w, float* c) {
  in_block_runs<NB>(m, [&](auto blocks, int nb, auto rows, int64_t r) {
    bf16_dot_rows<decltype(blocks)::value, decltype(rows)::value>(x + r * k_dim, k_dim, w + nb * k_dim * TILE_COLS,
                                                                  c + r * GROUP_COLS + nb * TILE_COLS);
  });
}
#else
constexpr bool HAS_AVX512_BF16 = false;
#endif

bool bf16_tiles() { return HAS_TILE_PRODUCT && tuning().isa_products && tiles_granted(); }
bool bf16_native() { return bf16_tiles() || (HAS_AVX512_BF16 && tuning().isa_products); }

// ---- formats, packing -------------------------------------------------------------------------------

bool is_float_packed(const at::Tensor& w) {
  return (w.scalar_type() == at::kFloat && w.dim() == 3 && w.size(2) == TILE_COLS) ||
         (w.scalar_type() == at::kBFloat16 && w.dim() == 5 && w.size(2) == 16 && w.size(3) == TILE_COLS && w.size(4) == 2);
}

bool is_packed(const at::Tensor& w, const c10::optional<at::Tensor>& scale) {
  if (!scale) return is_float_packed(w);
  if (w.scalar_type() == at::kChar) return (w.dim() == 3 && w.size(2) == TILE_COLS) || is_w8a8_packed(w);
  return is_int4_packed(w, *scale);
}

at::Tensor pack_float(const at::Tensor& w_in) {
  // a matrix's outputs padded with zero columns up to whole blocks (its caller keeps the first N: NativeLinear)
  const bool matrix = w_in.dim() == 2 && w_in.size(0) % TILE_COLS != 0 && w_in.size(0) > 0;
  const at::Tensor w = matrix ? at::constant_pad_nd(w_in, {0, 0, 0, -w_in.size(0) % TILE_COLS + TILE_COLS}) : w_in;
  const int64_t n = w.dim() >= 2 ? w.size(-2) : 0, k = w.dim() >= 2 ? w.size(-1) : 0;
  const bool shaped = tuning().native_products && (w.dim() == 2 || w.dim() == 3) && n % TILE_COLS == 0 && n > 0 && k > 0;
  if (shaped && w.scalar_type() == at::kFloat) {     // packed[nb][k][c] = W[16 nb + c][k]
    if (w.dim() == 3) return w.contiguous().view({w.size(0), n / 16, 16, k}).permute({0, 1, 3, 2}).contiguous();
    return w.contiguous().view({n / 16, 16, k}).permute({0, 2, 1}).contiguous();
  }
  if (!shaped || w.scalar_type() != at::kBFloat16 || k % 32 != 0) return w_in;
  // packed[nb][kb][p][c][e] = W[16 nb + c][32 kb + 2 p + e]
  if (w.dim() == 3)
    return w.contiguous().view({w.size(0), n / 16, 16, k / 32, 16, 2}).permute({0, 1, 3, 4, 2, 5}).contiguous();
  return w.contiguous().view({n / 16, 16, k / 32, 16, 2}).permute({0, 2, 3, 1, 4}).contiguous();
}

at::Tensor unpack_float(const at::Tensor& packed) {
  TORCH_CHECK(is_float_packed(packed), "unpack_float: not a packed float weight");
  if (packed.scalar_type() == at::kFloat) return packed.permute({0, 2, 1}).reshape({packed.size(0) * 16, packed.size(1)});
  return packed.permute({0, 3, 1, 2, 4}).reshape({packed.size(0) * 16, packed.size(1) * 32});
}

Weight weight_of(const at::Tensor& w, const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& bias,
                 int64_t x_width, at::ScalarType x_dtype, const char* caller) {
  TORCH_CHECK(is_packed(w, scale), caller, ": the weight is in no packed format (pack_float, or engine/models/quant.py)");
  TORCH_CHECK(w.is_contiguous(), caller, ": a packed weight must be contiguous");
  Weight out;
  out.data = w;
  out.blocks = w.size(0);
  if (!scale) {
    out.format = w.scalar_type() == at::kFloat ? Format::Float32 : Format::Bfloat16;
    out.k_dim = out.k_padded = out.format == Format::Float32 ? w.size(1) : w.size(1) * 32;
    out.n_dim = out.blocks * TILE_COLS;
    TORCH_CHECK(x_dtype == w.scalar_type(), caller, ": a packed ", w.scalar_type(), " weight takes ", w.scalar_type(),
                " rows, not ", x_dtype);
  } else if (w.dim() == 3) {
    out.format = Format::Int8;
    out.k_dim = out.k_padded = w.size(1);
  } else {
    out.format = w.dim() == 5 ? Format::W8A8 : Format::Int4;
    out.k_padded = out.format == Format::W8A8 ? w.size(1) * W8_K : w.size(1) * INT4_GROUP;
    out.k_dim = x_width;
    const int64_t step = out.format == Format::W8A8 ? W8_K : INT4_GROUP;
    TORCH_CHECK(x_width <= out.k_padded && x_width > out.k_padded - step, caller, ": input width ", x_width,
                " does not fit the weight's ", out.k_padded, " (padded) inputs");
  }
  if (scale) {
    out.scale = scale->contiguous();
    if (out.format == Format::Int4) {
      out.n_dim = out.blocks * TILE_COLS;
    } else {
      out.n_dim = scale->numel();
      TORCH_CHECK(scale->scalar_type() == at::kFloat && out.n_dim <= out.blocks * TILE_COLS &&
                  out.n_dim > (out.blocks - 1) * TILE_COLS, caller, ": scale must be float32 [N] for the packed blocks");
    }
  }
  TORCH_CHECK(x_width == out.k_dim, caller, ": input width ", x_width, " != the weight's ", out.k_dim);
  if (bias) {
    TORCH_CHECK(bias->numel() == out.n_dim && bias->scalar_type() == x_dtype, caller, ": bias must be [", out.n_dim,
                "] of the input's dtype");
    out.bias = bias->contiguous();
  }
  return out;
}

RowBuffers::RowBuffers(int64_t rows, int64_t k_padded)
    : xf(rows * k_padded), scales(rows * (k_padded / INT4_GROUP + 1)), q(rows * k_padded),
      sums(rows * (k_padded / INT4_GROUP + 1)) {}

std::string product_path(Format format) {
  switch (format) {
    case Format::Float32: return "portable " + std::to_string(VECTOR_BYTES * 8) + "-bit vectors";
    case Format::Bfloat16:
      return bf16_tiles() ? "AMX tiles" : bf16_native() ? "AVX512-BF16" : "bf16 widened on portable vectors";
    case Format::Int8: return "int8 widened on portable vectors";
    default: return quantized_path(format);
  }
}

// ---- the float formats' product -----------------------------------------------------------------------

// blocked_product's ops for the float formats: x as float rows (widened where T is not float), the sums
// widened from the weight's own elements, or its bf16 pairs in hardware; y = sums (* scale) (+ bias).
template <typename T>
struct FloatOps : NoSetup {
  const T* x;                 // the rows as given (bf16 pairs in hardware read them)
  const float* xf;            // the rows as float
  const Weight* w;
  T* y;
  bool widen = false, native_bf16 = false, tiles = false;
  const float* widened = nullptr;

  void group(int64_t first, int64_t nb) {
    if (!widen) return;
    const int64_t at = first * w->k_padded * TILE_COLS;
    widened = w->format == Format::Int8 ? widen_group<Int8Blocks>(w->data.data_ptr<int8_t>() + at, nb, w->k_padded)
                                        : widen_group<Bf16PairBlocks>(w->data.data_ptr<c10::BFloat16>() + at, nb, w->k_padded);
  }
  void setup(int64_t m) {
    if (tiles) tile_config(m);
  }
  void done() {
    if (tiles) tile_release();
  }

  template <typename Blocks>
  void pass(Blocks, int64_t m0, int64_t m, int64_t first, float* c) const {
    constexpr int NB = Blocks::value;
    const int64_t k = w->k_padded, at = first * k * TILE_COLS;
    if (widened) {                 // the chains of the format the weights were widened from
      if (w->format == Format::Int8) return float_pass<F32Blocks, NB, INT8_CHAINS>(xf + m0 * k, m, k, widened, c);
      return float_pass<F32Blocks, NB, 1>(xf + m0 * k, m, k, widened, c);
    }
    switch (w->format) {
      case Format::Float32: return float_pass<F32Blocks, NB, 1>(xf + m0 * k, m, k, w->data.data_ptr<float>() + at, c);
      case Format::Int8:
        return float_pass<Int8Blocks, NB, INT8_CHAINS>(xf + m0 * k, m, k, w->data.data_ptr<int8_t>() + at, c);
      default: break;
    }
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      const c10::BFloat16* wp = w->data.data_ptr<c10::BFloat16>();
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      if (tiles) return tile_pass<Bf16Tiles, NB>(x + m0 * k, k, wp, first, c);
#endif
#if defined(__AVX512BF16__)
      if (native_bf16) return bf16_dot_pass<NB>(x + m0 * k, m, k, wp + at, c);
#endif
    }
    float_pass<Bf16PairBlocks, NB, 1>(xf + m0 * k, m, k, w->data.data_ptr<c10::BFloat16>() + at, c);
  }

  void store(int64_t m0, int64_t m, int64_t first, int64_t nb, const float* c) const {
    const int64_t n0 = first * TILE_COLS, width = std::min(nb * TILE_COLS, w->n_dim - n0);
    const float* scale = w->scale.defined() ? w->scale.data_ptr<float>() + n0 : nullptr;
    const T* bias = w->bias.defined() ? w->bias.data_ptr<T>() + n0 : nullptr;
    for (int64_t r = 0; r < m; ++r) {
      T* out = y + (m0 + r) * w->n_dim + n0;
      const float* sums = c + r * GROUP_COLS;
      int64_t j = 0;
      if (width == nb * TILE_COLS) {      // whole blocks: 16 at a time
        for (; j < width; j += 16) {
          Vec16 v = load16(sums + j);
          if (scale) v *= load16(scale + j);
          if (bias) v += load16(bias + j);
          store16(out + j, v);
        }
      }
      for (; j < width; ++j) {
        float v = scale ? sums[j] * scale[j] : sums[j];
        out[j] = round_to<T>(bias ? v + to_float(bias[j]) : v);
      }
    }
  }
};

// x's rows as float: x itself for float32, else widened into `buffers` (the bf16 pairs' hardware paths
// read x as it is and widen nothing).
template <typename T>
const float* float_rows_of(const T* x, int64_t rows, int64_t k_dim, RowBuffers& buffers, bool alone) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    if (static_cast<int64_t>(buffers.xf.size()) < rows * k_dim) buffers.xf.resize(rows * k_dim);
    float* xf = buffers.xf.data();
    row_loop(rows, 16, alone, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin * k_dim; i < end * k_dim; ++i) xf[i] = to_float(x[i]);
    });
    return xf;
  }
}

template <typename T>
void product_into(const T* x, int64_t rows, int64_t k_dim, const Weight& w, RowBuffers& buffers, T* y, bool alone,
                  const Weight* next) {
  if (w.quantized_rows()) return quantized_product_into(x, rows, k_dim, w, buffers, y, alone, next);
  FloatOps<T> ops;
  ops.x = x;
  ops.w = &w;
  ops.y = y;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    ops.tiles = w.format == Format::Bfloat16 && bf16_tiles();
    ops.native_bf16 = w.format == Format::Bfloat16 && bf16_native();
  }
  const bool hardware = ops.tiles || ops.native_bf16;
  const int64_t widen_past = w.format == Format::Int8 ? WIDEN_INT8_ROWS : WIDEN_ROWS;
  ops.widen = !hardware && w.format != Format::Float32 && rows > widen_past && tuning().widen_once;
  ops.xf = hardware ? nullptr : float_rows_of(x, rows, k_dim, buffers, alone);
  blocked_product<float>(rows, w.blocks, ops, next);
}

template void product_into<float>(const float*, int64_t, int64_t, const Weight&, RowBuffers&, float*, bool,
                                  const Weight*);
template void product_into<c10::BFloat16>(const c10::BFloat16*, int64_t, int64_t, const Weight&, RowBuffers&,
                                          c10::BFloat16*, bool, const Weight*);
template void product_into<c10::Half>(const c10::Half*, int64_t, int64_t, const Weight&, RowBuffers&, c10::Half*,
                                      bool, const Weight*);

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                  const c10::optional<at::Tensor>& scale) {
  if (!is_packed(weight, scale)) {
    TORCH_CHECK(!scale, "linear: a scale comes with a packed int8 or int4 weight");
    return at::linear(x_in, weight, bias);
  }
  if (!scale && !tuning().native_products) return at::linear(x_in, unpack_float(weight), bias);    // benchmarks only
  const int64_t k_dim = x_in.size(-1);
  const Weight w = weight_of(weight, scale, bias, k_dim, x_in.scalar_type(), "linear");
  const auto x = x_in.reshape({-1, k_dim}).contiguous();
  const int64_t rows = x.size(0);
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = w.n_dim;
  auto y = empty({rows, w.n_dim}, x.options());
  if (rows == 0) return y.view(out_shape);
  RowBuffers buffers(w.quantized_rows() ? rows : 0, w.k_padded);
  TANDEM_DISPATCH(x.scalar_type(), "linear", [&] {
    product_into(x.data_ptr<scalar_t>(), rows, k_dim, w, buffers, y.data_ptr<scalar_t>());
  });
  return y.view(out_shape);
}

}  // namespace tandem
