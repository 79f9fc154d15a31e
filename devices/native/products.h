// The matrix products y [M, N] = x [M, K] . W (+ bias) of a layer, for every row count: decode steps (a
// few rows, where reading W is the cost), verify runs, draft steps and prompt chunks (many rows, where the
// multiply-adds are). W is packed once at load into blocks of 16 output columns, each block's inputs one
// after another, so that a pass reads a block front to back, multiplies each vector of it by every row of
// x it runs while the vector is in registers, and sums 16 columns side by side (no sums across lanes).
// Each column's sum runs over its inputs in order whatever rows share the pass, so a row's outputs never
// depend on its batch: a verify run reads what its decode steps would, and greedy speculation keeps plain
// decoding's tokens.
//
// The formats (what engine/models hold; pack_float and engine/models/quant.py make them):
//
//   format     weight                                    scale                      x and sums
//   float32    float [N/16, K, 16]                       -                          float, float sums
//   bfloat16   bf16 [N/16, K/32, 16, 16, 2] (input       -                          float sums (bf16 pairs:
//              pairs of 16 columns, AMX's B operand)                                AVX512-BF16 or AMX)
//   int8       int8 [N/16, K, 16], weight-only           float [N] per column       float x, float sums
//   w8a8_int8  int8 [N/16, K/64, 16, 16, 4]              float [N] per column       x quantized per row,
//              (input quads, AMX/VNNI's B operand)                                  exact int32 sums
//   int4       uint8 [N/16, K/32, 4, 64]: 32 inputs of   float16 [N/16, K/32, 16]   x quantized per group
//              16 columns a group, two quads a byte      per (column, group)        of 32, int32 per group
//
// N and K are zero-padded to whole blocks where a format needs it (the scale's length is the true N).
#pragma once

#include "common.h"

namespace tandem {

constexpr int64_t TILE_ROWS = 16, TILE_COLS = 16;   // rows of x a pass, output columns a block
constexpr int64_t TILE_GROUP = 4;                    // column blocks a group: 64 outputs a thread takes at once
constexpr int64_t GROUP_COLS = TILE_GROUP * TILE_COLS;
constexpr int64_t INT4_GROUP = 32;                   // inputs sharing one int4 scale (llama.cpp's q4_0 block)
constexpr int64_t W8_K = 64;                         // inputs of a W8A8 block

enum class Format { Float32, Bfloat16, Int8, W8A8, Int4 };

// A packed weight as the products read it: its format, tensors (contiguous) and shape.
struct Weight {
  Format format;
  at::Tensor data, scale, bias;   // bias: undefined where there is none
  int64_t n_dim = 0;              // outputs (the scale's length where there is one)
  int64_t k_dim = 0;              // inputs x has (W8A8 and int4: any width within k_padded)
  int64_t k_padded = 0;           // inputs the packed blocks hold
  int64_t blocks = 0;             // column blocks of 16

  bool quantized_rows() const { return format == Format::W8A8 || format == Format::Int4; }
};

// Whether `w` (with `scale`) is in one of the packed formats; weight_of checks it against x's width and
// dtype and the bias, with `caller` in the error.
bool is_packed(const at::Tensor& w, const c10::optional<at::Tensor>& scale);
Weight weight_of(const at::Tensor& w, const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& bias,
                 int64_t x_width, at::ScalarType x_dtype, const char* caller);

// Buffers for the rows of x as a product reads them: float copies of bf16 rows, or rows quantized to int8
// with their scales (per row for W8A8, per group of 32 for int4) and, for int4, each group's sum. Sized for
// `rows` rows of at most `k_padded` inputs; a team's own rows use one per thread (TeamRows).
struct RowBuffers {
  std::vector<float> xf, scales;
  std::vector<int8_t> q;
  std::vector<int32_t> sums;
  RowBuffers() = default;
  RowBuffers(int64_t rows, int64_t k_padded);
};

// y [rows, n_dim] = x [rows, k_dim] . w (+ bias) on raw rows, the rows prepared into `buffers` (on this
// thread alone where `alone`, else spread: a team's shared buffers). The loop over columns is spread.
// `next`: the product a team runs after this one, whose first weights each thread asks for once it has
// read its share of these (fetch_share_start).
template <typename T>
void product_into(const T* x, int64_t rows, int64_t k_dim, const Weight& w, RowBuffers& buffers, T* y,
                  bool alone = false, const Weight* next = nullptr);

// x [..., K] . W (+ bias) as tensors: a packed weight natively, else torch's product.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                  const c10::optional<at::Tensor>& scale);

// W [N, K] (or a stack [E, N, K]) packed for the float products where they run (float32 and bf16; bf16's K
// a multiple of 32; a matrix's N padded with zero columns up to a multiple of 16, a stack's already one),
// else W itself; the [N, K] matrix of a packed float weight (N padded).
at::Tensor pack_float(const at::Tensor& w);
at::Tensor unpack_float(const at::Tensor& packed);
bool is_float_packed(const at::Tensor& w);

// Which path a format's products take on this build and CPU, in the start-up log's words.
std::string product_path(Format format);
bool bf16_native();                  // bf16 pairs multiply in hardware here (AVX512-BF16 or AMX)

// A pass reads its block front to back and a thread's blocks lie one after another, yet the hardware
// prefetcher alone kept an int4 decode pass below the rate a plain read of the same bytes reaches: the
// pass computes between its loads (unpacking, scales), so fewer reads are in flight. A pass asks for the
// bytes WEIGHT_FETCH_AHEAD ahead of those it reads (the tuning record's weight_prefetch; 0: none). Past a
// thread's last block that is bytes no one reads then, or past the weight's end: a prefetch never faults.
constexpr int64_t WEIGHT_FETCH_AHEAD = 4096;

inline int64_t weight_fetch_ahead() { return tuning().weight_prefetch ? WEIGHT_FETCH_AHEAD : 0; }

// Asks for the 64-byte lines of [p, p + bytes).
inline void fetch_lines(const char* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
}

// The lines of [p + ahead, p + ahead + bytes), where ahead is not 0: a pass about to read [p, p + bytes).
inline void fetch_weights(const void* p, int64_t ahead, int64_t bytes) {
  if (ahead != 0) fetch_lines(static_cast<const char*>(p) + ahead, bytes);
}

// Between two products a team waits at a barrier, then runs a layer's row-wise steps, and each thread's
// stream of weights starts again from a miss, which weighs most where a product is shortest (4-bit
// weights). A thread that has read its share of one product asks for the first WEIGHT_FETCH_AHEAD bytes
// of its share of the next (split by spread's rule, as blocked_product splits it): the bytes its passes'
// own prefetch does not cover, in flight while the team waits.
inline void fetch_share_start(const Weight& next) {
  const Team* team = current_team;
  const int64_t ahead = weight_fetch_ahead();
  if (team == nullptr || ahead == 0 || next.blocks == 0) return;
  const int64_t groups = (next.blocks + TILE_GROUP - 1) / TILE_GROUP;
  const int64_t parts = std::min<int64_t>(team->size, groups), chunk = (groups + parts - 1) / parts;
  const int64_t from = team->rank * chunk;
  if (from >= groups) return;
  const int64_t group_bytes = next.data.nbytes() / next.blocks * TILE_GROUP;
  fetch_lines(static_cast<const char*>(next.data.data_ptr()) + from * group_bytes,
              std::min(ahead, (groups - from) * group_bytes));
}

// The loop of a blocked product: groups of TILE_GROUP column blocks split across the threads (a thread
// reads only its own columns of W, each group once), and for each group the rows in tiles of TILE_ROWS;
// then the start of the thread's share of `next`, the product after this one (fetch_share_start).
// ops.group(first, nb) runs before a group's tiles (a pass that widens the group's weights to floats once
// for all its rows does it there); ops.setup(m) before a tile of m rows where m changed (AMX configures its
// tiles there) and ops.done() after the thread's last; ops.pass(NB, m0, m, first, c) leaves in c
// [m][GROUP_COLS] the sums of rows m0 .. m0 + m against blocks first .. first + NB; ops.store(m0, m, first,
// nb, c) writes them out.
template <typename Sum, typename Ops>
void blocked_product(int64_t rows, int64_t n_blocks, const Ops& shared_ops, const Weight* next = nullptr) {
  const int64_t groups = (n_blocks + TILE_GROUP - 1) / TILE_GROUP;
  spread(0, groups, 1, [&](int64_t begin, int64_t end) {
    Ops ops(shared_ops);                      // each thread's own (the state group() leaves)
    alignas(64) Sum c[TILE_ROWS * GROUP_COLS];
    int64_t configured = -1;
    for (int64_t g = begin; g < end; ++g) {
      const int64_t first = g * TILE_GROUP, nb = std::min(TILE_GROUP, n_blocks - first);
      ops.group(first, nb);
      for (int64_t m0 = 0; m0 < rows; m0 += TILE_ROWS) {
        const int64_t m = std::min(TILE_ROWS, rows - m0);
        if (m != configured) ops.setup(m), configured = m;
        with_count<TILE_GROUP>(nb, [&](auto blocks) { ops.pass(blocks, m0, m, first, c); });
        ops.store(m0, m, first, nb, c);
      }
    }
    if (configured >= 0) ops.done();
    if (next != nullptr) fetch_share_start(*next);
  });
}

// What a product's ops do by default before a group, a tile, and after the last.
struct NoSetup {
  void group(int64_t, int64_t) {}
  void setup(int64_t) {}
  void done() {}
};

// How many rows a pass runs against a weight block at once, by what the build's registers hold: each row's
// 16 sums for each of S blocks and C chains (below), beside a weight vector and a broadcast input, within
// three quarters of the registers, at most 8: 8 where 16 floats are one register (AVX-512), 6 where they are
// two (AVX2) or four of 32 registers (NEON), 3 where four of 16 (SSE). A verify run of 4-5 drafts and its
// bonus token, or a tile of 16 prompt rows, is read in as few runs as that allows, so each weight vector is
// loaded once for all of them.
constexpr int run_limit(int blocks, int chains) {
  const int most = VEC16_REGISTERS * 3 / 4 / (blocks * chains);
  return most < 1 ? 1 : most > 8 ? 8 : most;
}
constexpr int MAX_RUN = run_limit(1, 1);

// run(R, r) over the rows [0, m) of a pass in runs of at most MAX_R rows (at most 4 with the tuning's
// wide_row_runs off, for benchmarks), R a template constant; a row's sums are the same in any run.
template <int MAX_R, typename Run>
void in_row_runs(int64_t m, const Run& run) {
  const int64_t most = tuning().wide_row_runs ? MAX_R : std::min(MAX_R, 4);
  for (int64_t r = 0; r < m; r += most)
    with_count<8>(std::min(most, m - r), [&](auto rows) {
      if constexpr (decltype(rows)::value <= MAX_R) run(rows, r);
    });
}

// run(S, nb, R, r) over the NB blocks of a group and the rows [0, m): a block at a time (S = 1) when a pass
// reads its weights from memory at a few rows, so that a thread's weights are one sequential stream; two
// at a time (S = 2) for more rows where the registers hold both blocks' sums of a run (AVX-512), so that a
// broadcast input feeds two multiply-adds and the sums, not the reads, are the cost. CHAINS: the sums each
// row keeps a column (run_limit).
template <int NB, int CHAINS = 1, typename Run>
void in_block_runs(int64_t m, const Run& run) {
  constexpr bool PAIRS = VEC16_REGISTERS >= 32;
  int nb = 0;
  if constexpr (PAIRS && NB >= 2) {
    if (m > 4 && tuning().paired_blocks)
      for (; nb + 2 <= NB; nb += 2)
        in_row_runs<run_limit(2, CHAINS)>(m, [&](auto rows, int64_t r) {
          run(std::integral_constant<int, 2>{}, nb, rows, r);
        });
  }
  for (; nb < NB; ++nb)
    in_row_runs<run_limit(1, CHAINS)>(m, [&](auto rows, int64_t r) {
      run(std::integral_constant<int, 1>{}, nb, rows, r);
    });
}

}  // namespace tandem
