// What every kernel file shares: the tuning record (the A/B switches benchmarks and tests flip), the
// team of threads that runs a whole layer stack in one parallel region, and the argument checks.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <omp.h>

#include <atomic>
#include <exception>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "vec.h"

namespace tandem {

// The switches that choose between two ways of computing the same thing, each on by default: benchmarks
// time both sides, tests check that both give the same values. Set from Python between calls
// (bindings: set_tuning), read by the kernels at each call.
struct Tuning {
  std::atomic<bool> teams{true};           // a layer stack or a draft chain in one parallel region
  std::atomic<bool> own_rows{true};        // at a few rows, each team thread runs the row-wise steps itself
  std::atomic<bool> wide_row_runs{true};   // a verify run's 5-6 rows in one pass where the registers hold them
  std::atomic<bool> kv_prefetch{true};     // attention fetches key and value rows ahead of reading them
  std::atomic<bool> isa_products{true};    // the ISA-specific products (AMX, AVX512-BF16, VNNI, AVX2 int8); off: portable
  std::atomic<bool> native_products{true}; // off: float products through torch on the unpacked weight
  std::atomic<bool> paired_blocks{true};   // a run of many rows reads two column blocks at once where it can
  std::atomic<bool> widen_once{true};      // many rows: a group's int8/bf16 weights widened once, not each run
  std::atomic<bool> weight_prefetch{true}; // a pass asks for its weights WEIGHT_FETCH_AHEAD bytes ahead of reading them
};
Tuning& tuning();

// The names set_tuning takes, in Tuning's order, and their switches.
std::vector<std::pair<std::string, std::atomic<bool>*>> tuning_switches();

// The threads of one parallel region opened for a whole layer stack (dense_layers) or draft chain, instead
// of one region for each kernel's loop: at a few rows a region's fork and join cost more than its work, and
// between regions one thread ran the host code while the others spun. In a team every thread runs the same
// host code on buffers allocated before the region, and each loop is the thread's share then a barrier.
struct Team {
  int rank, size;
  std::atomic<bool>* failed;        // a share threw: later loops run nothing (see spread)
  std::exception_ptr* error;        // the first exception, rethrown after the region
};
extern thread_local const Team* current_team;

// f over [begin, end) in parts. Outside a team: at::parallel_for. In one: this thread's part, split as
// at::parallel_for splits (min(threads, ceil(n / grain)) contiguous parts; a range of grain or less is rank
// 0's alone), then a barrier, after which every thread sees every part written. Each loop's parts are
// independent (rows, column blocks, (sequence, kv head) jobs), so the values are the same however the range
// is split. An exception in a part is kept, not thrown: every thread must reach every barrier, so the team
// runs on, each later loop skipped, and the region's owner rethrows it.
template <typename F>
void spread(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const Team* team = current_team;
  if (team == nullptr) return at::parallel_for(begin, end, grain, f);
  const int64_t n = end - begin;
  if (n > 0 && !team->failed->load()) {
    const int64_t parts = std::min<int64_t>(team->size, (n + grain - 1) / std::max<int64_t>(grain, 1));
    const int64_t chunk = (n + parts - 1) / parts, from = begin + team->rank * chunk;
    if (from < end) {
      try {
        f(from, std::min(end, from + chunk));
      } catch (...) {
        if (!team->failed->exchange(true)) *team->error = std::current_exception();
      }
    }
  }
#pragma omp barrier
}

// f over rows [0, rows): all on this thread where `alone` (a team's rows of its own: OWN_ROWS), else spread.
template <typename F>
void row_loop(int64_t rows, int64_t grain, bool alone, const F& f) {
  if (alone) return f(0, rows);
  spread(0, rows, grain, f);
}

// f(team) on every thread of one region (a Team); an exception from a loop or from f is rethrown after it.
// f must throw outside a loop only where every thread throws (the same check on the same values).
template <typename F>
void in_team(const F& f) {
  std::atomic<bool> failed{false};
  std::exception_ptr error;
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const Team team{omp_get_thread_num(), omp_get_num_threads(), &failed, &error};
    current_team = &team;
    try {
      f(team);
    } catch (...) {
      if (!failed.exchange(true)) error = std::current_exception();
    }
    current_team = nullptr;
  }
  if (error) std::rethrow_exception(error);
}

// f(std::integral_constant<int, n>) for n = 1..MAX (any other n: 1): block and row counts as template
// arguments, so that the loops over them unroll and their sums stay in registers.
template <int MAX, typename F>
void with_count(int64_t n, const F& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) {
    const bool matched = ((n == I + 1 && (f(std::integral_constant<int, I + 1>{}), true)) || ...);
    if (!matched) f(std::integral_constant<int, 1>{});
  }(std::make_integer_sequence<int, MAX>{});
}

// At most this many rows, each thread of a team runs the row-wise steps (norms, the residual adds, SwiGLU,
// the rows' quantization) over every row into its own buffers, the same values, instead of sharing them out
// and waiting at a barrier: at a few rows a barrier costs more than the rows.
constexpr int64_t OWN_ROWS = 16;

void check_cpu_rows(const at::Tensor& t, const char* name);

// at::empty with these sizes and options (one place that includes the operator's header).
at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options);

struct Heads {
  int64_t q, kv, dim;
};

}  // namespace tandem

// AT_DISPATCH over the activations' dtypes (float32, bf16, float16) without ATen's dispatch header's weight.
#define TANDEM_DISPATCH(dtype, name, ...)                                         \
  [&] {                                                                           \
    switch (dtype) {                                                              \
      case at::kFloat: { using scalar_t = float; return __VA_ARGS__(); }          \
      case at::kBFloat16: { using scalar_t = c10::BFloat16; return __VA_ARGS__(); } \
      case at::kHalf: { using scalar_t = c10::Half; return __VA_ARGS__(); }       \
      default: TORCH_CHECK(false, name, ": unsupported dtype ", dtype);           \
    }                                                                             \
  }()
