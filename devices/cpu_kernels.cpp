// Native CPU kernels for a decoder layer's glue: RMSNorm (with the residual add), SwiGLU's
// silu(gate) * up, and attention that applies the rotary embedding, writes the new keys and
// values into the slot-indexed KV cache and attends over each sequence's cached keys in place
// (no gather of the keys into a padded batch, no mask tensor).
//
// Each is one call from Python where the pure-torch path (engine/models/layers.py) runs 5-20
// small operators. The matrix products of a few rows (decode, verify, draft steps) run here too,
// float32 and bf16 (float_linear) and weight-only int8 (int8_linear), where reading the weights is
// the cost; larger ones stay with torch (oneDNN/MKL), except bf16 weights packed for AMX tiles or
// AVX512-BF16 vectors (packed_product) and W8A8's (w8a8_linear), which run here at every row count. Loaded by
// devices/cpu_native.py, which falls back to the pure-torch path when this does not build.
//
// Layout (engine/models/attention.py: SeqLayout): sequence b owns tokens q_start[b] ..
// q_start[b] + q_len[b] of the batch; its kv_len[b] positions include them, so token i of b sits
// at position kv_len[b] - q_len[b] + i and sees keys 0 ..= that position. table[rows[b]][p] is
// the KV slot of position p of sequence b.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace {

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
// keeps scalar: a SiLU over a verify run's rows spent most of its time there).
template <typename T>
inline T round_to(float x) { return static_cast<T>(x); }

template <>
inline c10::BFloat16 round_to<c10::BFloat16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return c10::BFloat16(static_cast<uint16_t>(x != x ? 0x7FC0u : rounded), c10::BFloat16::from_bits());
}

void check_cpu_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, width] with unit stride along the width");
}

// While alive, the thread treats subnormal floats as zero (MXCSR's FTZ and DAZ), restored after. For
// loops of fast_exp: the compiler evaluates the clamped ends of its range for every element and
// keeps what applies, and SiLU's x / (1 + e^88) there is subnormal: each such vector took a
// microcode assist, 15x the loop's time (a verify run's SwiGLU cost more than its product).
struct FlushSubnormals {
  const unsigned saved = _mm_getcsr();
  FlushSubnormals() { _mm_setcsr(saved | 0x8040); }
  ~FlushSubnormals() { _mm_setcsr(saved); }
};

// The threads of one parallel region opened for a whole layer stack (dense_layers), instead of one
// region for each kernel's loop. A forward at a few rows opened some 40 regions, each a fork and a
// join of a few microseconds of work, and between them one thread ran the host code (tensors
// allocated, operators dispatched) while the other spun: in a 1 x 1 bf16 forward (perf, an AMD EPYC)
// the second thread did kernel work 36% of its time and spun in libgomp for most of the rest. In a
// team every thread runs the same host code on buffers allocated before the region, and each loop
// is the thread's share of the range followed by a barrier.
struct Team {
  int rank, size;
  std::atomic<bool>* failed;        // a share threw: later loops run nothing (see spread)
  std::exception_ptr* error;        // the first exception, rethrown after the region
};
thread_local const Team* current_team = nullptr;

// Off: dense_layers opens a region per loop, as before teams (benchmarks and tests measure both).
std::atomic<bool> teams_enabled{true};

void set_teams(bool enabled) { teams_enabled = enabled; }

std::atomic<int64_t> team_stacks{0};      // stacks run in a team since the module loaded (tests)
int64_t team_stacks_run() { return team_stacks.load(); }

// f over [begin, end) in parts. Outside a team: at::parallel_for. In one: this thread's part, split as
// at::parallel_for splits (min(threads, ceil(n / grain)) contiguous parts; a range of grain or less
// is rank 0's alone), then a barrier, after which every thread sees every part written. Each loop's
// parts are independent (rows, column blocks, (sequence, kv head) jobs), so the values are the same
// however the range is split. An exception in a part is kept, not thrown: every thread must reach
// every barrier, so the team runs on, each later loop skipped, and the region's owner rethrows it.
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

// e^x to about 1 ulp for x in [-87, 88] (clamped there): Cephes' range reduction and polynomial,
// written so that the compiler vectorizes a loop of it (libm's expf is a call per element, and was
// most of the softmax's and the SiLU's time).
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

// 16 floats a vector (one AVX-512 register, two AVX2 ones): the products' and attention's unit.
typedef float Vec16 __attribute__((vector_size(64)));
typedef float Vec8 __attribute__((vector_size(32)));
typedef uint16_t U16x16 __attribute__((vector_size(32)));
typedef uint32_t U32x16 __attribute__((vector_size(64)));

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

#if defined(__AVX512F__)
// 16 values as one AVX-512 register, read and written with explicit instructions where the compiler's
// own vectorization of the scalar loops was poor (W8A8's row quantization and the tile products' stores:
// bf16 unpacked 8 lanes at a time with mask shuffles).
inline __m512 load_ps(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_ps(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void store_ps(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store_ps(c10::BFloat16* p, __m512 v) {      // round_to<c10::BFloat16>, 16 lanes at once
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
#endif
template <typename T>
constexpr bool VECTOR_TYPE = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

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

// out = weight * (x / rms(x)), normalized in float32 and rounded to the input dtype before the
// weight (as the pure-torch RMSNorm and Hugging Face do).
template <typename T>
void rms_norm_rows(const T* x, const T* weight, T* out, int64_t width, float eps) {
  float sum = 0.f;
_Pragma("omp simd reduction(+ : sum)")
  for (int64_t j = 0; j < width; ++j) sum += to_float(x[j]) * to_float(x[j]);
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(width) + eps);
  for (int64_t j = 0; j < width; ++j) {
    const T normed = round_to<T>(to_float(x[j]) * inv);
    out[j] = round_to<T>(to_float(weight[j]) * to_float(normed));
  }
}

// The row loops of rms_norm, add_rms_norm and silu_mul on raw rows (row_loop: spread, or all rows on
// this thread where `alone`).
template <typename T>
void rms_norm_into(const T* x, const T* weight, T* out, int64_t rows, int64_t width, float eps, bool alone = false) {
  row_loop(rows, 16, alone, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_rows(x + r * width, weight, out + r * width, width, eps);
  });
}

template <typename T>
void add_rms_norm_into(const T* x, const T* delta, const T* weight, T* h, T* out, int64_t rows, int64_t width,
                       float eps, bool alone = false) {
  row_loop(rows, 16, alone, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t j = 0; j < width; ++j) h[r * width + j] = round_to<T>(to_float(x[r * width + j]) + to_float(delta[r * width + j]));
      rms_norm_rows(h + r * width, weight, out + r * width, width, eps);
    }
  });
}

template <typename T>
void silu_mul_into(const T* gate_up, int64_t stride, T* out, int64_t rows, int64_t inter, bool alone = false) {
  row_loop(rows, 8, alone, [&](int64_t begin, int64_t end) {
    const FlushSubnormals flush;
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * stride;
      const T* u = g + inter;
      T* o = out + r * inter;
_Pragma("omp simd")
      for (int64_t j = 0; j < inter; ++j) {
        const float gate = to_float(g[j]);
        const T act = round_to<T>(gate / (1.f + fast_exp(-gate)));
        o[j] = round_to<T>(to_float(act) * to_float(u[j]));
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps) {
  const auto x = x_in.reshape({-1, x_in.size(-1)}).contiguous();
  auto out = at::empty_like(x);
  const int64_t rows = x.size(0), width = x.size(1);
  TORCH_CHECK(weight.numel() == width && weight.scalar_type() == x.scalar_type(), "rms_norm: weight must be [", width, "] of the input's dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_into(x.data_ptr<scalar_t>(), weight.contiguous().data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows,
                  width, static_cast<float>(eps));
  });
  return out.view(x_in.sizes());
}

// (h, norm(h)) with h = x + delta: the residual add and the next RMSNorm in one pass.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x_in, const at::Tensor& delta_in,
                                                const at::Tensor& weight, double eps) {
  const auto x = x_in.reshape({-1, x_in.size(-1)}).contiguous();
  const auto delta = delta_in.reshape({-1, x_in.size(-1)}).contiguous();
  TORCH_CHECK(x.sizes() == delta.sizes() && x.scalar_type() == delta.scalar_type(), "add_rms_norm: x and delta differ");
  auto h = at::empty_like(x);
  auto out = at::empty_like(x);
  const int64_t rows = x.size(0), width = x.size(1);
  TORCH_CHECK(weight.numel() == width && weight.scalar_type() == x.scalar_type(), "add_rms_norm: weight must be [", width, "] of the input's dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_into(x.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(), weight.contiguous().data_ptr<scalar_t>(),
                      h.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, width, static_cast<float>(eps));
  });
  return {h.view(x_in.sizes()), out.view(x_in.sizes())};
}

// [T, 2I] (gate | up) -> [T, I]: silu(gate) * up, each rounded to the dtype as torch's two ops do.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_cpu_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * inter, "silu_mul: the width must be even");
  auto out = at::empty({rows, inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_into(gate_up.data_ptr<scalar_t>(), gate_up.stride(0), out.data_ptr<scalar_t>(), rows, inter);
  });
  return out;
}

struct Heads {
  int64_t q, kv, dim;
};

// One head vector (dim floats) normalized in place (Qwen3's per-head RMSNorm before the rotary embedding).
template <typename T>
void head_norm(float* v, const T* weight, int64_t dim, float eps) {
  float sum = 0.f;
  for (int64_t d = 0; d < dim; ++d) sum += v[d] * v[d];
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
  for (int64_t d = 0; d < dim; ++d) v[d] = to_float(static_cast<T>(to_float(static_cast<T>(v[d] * inv)) * to_float(weight[d])));
}

// The half-split rotary embedding of Hugging Face Llama, in place: cos_sin holds cos(angle_j) for
// j < dim / 2, then sin(angle_j) (one row of rope_table).
inline void rotate(float* v, const float* cos_sin, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float c = cos_sin[j], s = cos_sin[half + j];
    const float a = v[j], b = v[j + half];
    v[j] = a * c - b * s;
    v[j + half] = b * c + a * s;
  }
}

// [T, head_dim] float32: row t is cos | sin of position(t) * inv_freq (see the layout at the top),
// computed once a forward and read by every layer's attention.
at::Tensor rope_table(const at::Tensor& q_start, const at::Tensor& q_len, const at::Tensor& kv_len, int64_t tokens,
                      const at::Tensor& inv_freq) {
  const int64_t half = inv_freq.numel(), seqs = q_start.numel();
  auto table = at::zeros({tokens, 2 * half}, inv_freq.options());
  const int64_t* qs = q_start.data_ptr<int64_t>();
  const int64_t* ql = q_len.data_ptr<int64_t>();
  const int64_t* kl = kv_len.data_ptr<int64_t>();
  const float* freq = inv_freq.data_ptr<float>();
  float* out = table.data_ptr<float>();
  for (int64_t b = 0; b < seqs; ++b) {
    TORCH_CHECK(qs[b] >= 0 && ql[b] >= 0 && qs[b] + ql[b] <= tokens, "rope_table: sequence ", b, " outside the tokens");
    for (int64_t i = 0; i < ql[b]; ++i) {
      const float position = static_cast<float>(kl[b] - ql[b] + i);
      float* row = out + (qs[b] + i) * 2 * half;
      for (int64_t j = 0; j < half; ++j) {
        const float angle = position * freq[j];
        row[j] = std::cos(angle);
        row[half + j] = std::sin(angle);
      }
    }
  }
  return table;
}

// Runs of up to this many tokens a sequence (decodes, verify runs, draft steps, short prompt chunks)
// read every key from the cache row by row (attend_in_registers); longer prompt chunks gather the keys
// once and attend by two matrix products (torch's, whose sums depend on the shapes). A verify run of k
// tokens must read the numbers k decode steps would: with the switch at 8 query rows, a bf16 verify
// of 4 tokens (2 query heads a kv head) attended by products, and EAGLE-3's greedy tokens left plain
// decoding's on an Intel Xeon (tests/test_bf16_spec.py). 64: the rows the native products take.
constexpr int64_t MAX_TOKENS_IN_REGISTERS = 64;

// Many queries a sequence (verify runs of many sequences, prompt chunks): the (sequence, kv head)'s
// keys and values gathered once into float matrices, scores and outputs as two matrix products.
template <typename T>
void attend_by_products(const float* const* query, int64_t n_rows, int64_t group, int64_t keys, int64_t first,
                        const int64_t* slots, const T* kc, const T* vc, int64_t kv_heads, int64_t kv_head,
                        int64_t dim, float softmax_scale, T* const* out_rows) {
  auto opts = at::TensorOptions().dtype(at::kFloat);
  auto q = at::empty({n_rows, dim}, opts), k = at::empty({keys, dim}, opts), v = at::empty({keys, dim}, opts);
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  for (int64_t r = 0; r < n_rows; ++r) std::memcpy(qp + r * dim, query[r], dim * sizeof(float));
  for (int64_t j = 0; j < keys; ++j) {
    const T* ks = kc + (slots[j] * kv_heads + kv_head) * dim;
    const T* vs = vc + (slots[j] * kv_heads + kv_head) * dim;
    for (int64_t d = 0; d < dim; ++d) {
      kp[j * dim + d] = to_float(ks[d]);
      vp[j * dim + d] = to_float(vs[d]);
    }
  }
  auto scores = at::mm(q, k.t());                       // [n_rows, keys]
  float* sp = scores.data_ptr<float>();
  for (int64_t r = 0; r < n_rows; ++r) {
    float* row = sp + r * keys;
    const int64_t visible = first + r / group + 1;
    const float norm = 1.f / exp_shifted(row, visible, softmax_scale);
    for (int64_t j = 0; j < visible; ++j) row[j] *= norm;
    for (int64_t j = visible; j < keys; ++j) row[j] = 0.f;
  }
  auto out = at::mm(scores, v);                          // [n_rows, dim]
  const float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < n_rows; ++r)
    for (int64_t d = 0; d < dim; ++d) out_rows[r][d] = round_to<T>(op[r * dim + d]);
}

// Keys and values a sequence holds sit wherever its slots are: a decode step allocates one slot a
// sequence, so the slots of requests decoding side by side interleave (and free slots are reused in
// any order), each key another cache row, too far from the last for the hardware prefetcher. Each
// row was a miss waiting on memory: the first loads of a key and of a value took 65% of attention's
// samples, itself 72% of a 16-row bf16 decode step's (perf), at about 700 keys of context. attend_rows
// asks for the rows FETCH_AHEAD keys ahead of the ones it reads (8 ahead gained less than 32;
// bench/cpu_kernels.py --context 1000, column native-no-kv-prefetch).
constexpr int64_t FETCH_AHEAD = 32;

// Off: attention fetches no key or value row ahead (benchmarks measure both).
std::atomic<bool> kv_prefetch_enabled{true};

void set_kv_prefetch(bool enabled) { kv_prefetch_enabled = enabled; }

template <typename T, int64_t DIM>
inline void fetch_row(const T* row) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < DIM * int64_t(sizeof(T)); b += 64) __builtin_prefetch(bytes + b, 0, 3);
}

// Query rows of a (sequence, kv head) read in registers (decode steps, verify runs, draft steps), for
// head dims of NV * 16: R rows at a time (two for head dim 64, where their queries and dot sums fit
// the registers; one for 128) read each key and value from the cache once; each row's query and
// output accumulator stay in registers, and the dot products of eight keys are reduced side by side
// (sum_lanes8). Row r sees keys 0 ..= first + r / group. A row's sums are the same whatever rows it
// is read with: its dots are its own lanes, its softmax and its outputs its own, added key by key in
// order over exactly its visible keys, so a verify run reads what its decode steps would.
template <int NV, int R, typename T>
void attend_rows(const float* const* query, int64_t r0, int64_t group, int64_t first, const int64_t* slots,
                 const T* keys, const T* values, int64_t stride, float softmax_scale, float* scores, int64_t keys_n,
                 T* const* out_rows) {
  constexpr int64_t dim = NV * 16;
  int64_t visible[R];
  Vec16 q[R][NV];
  for (int r = 0; r < R; ++r) {
    visible[r] = first + (r0 + r) / group + 1;        // non-decreasing in r
    for (int v = 0; v < NV; ++v) q[r][v] = load16(query[r0 + r] + 16 * v);
  }
  const int64_t last = visible[R - 1];
  const int64_t ahead = kv_prefetch_enabled ? FETCH_AHEAD : last;      // `last`: nothing fetched ahead
  for (int64_t j = 0; j < last; j += 8) {
    const int64_t block = std::min<int64_t>(8, last - j);
    for (int64_t i = j + ahead; i < std::min(j + ahead + 8, last); ++i)
      fetch_row<T, dim>(keys + slots[i] * stride);
    Vec16 part[R][8];
    for (int i = 0; i < 8; ++i) {
      for (int r = 0; r < R; ++r) part[r][i] = Vec16{};
      if (i < block) {
        const T* k = keys + slots[j + i] * stride;
        for (int v = 0; v < NV; ++v) {
          const Vec16 kv = load16(k + 16 * v);
          for (int r = 0; r < R; ++r) part[r][i] += q[r][v] * kv;
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const Vec8 dots = sum_lanes8(part[r]);         // lane i: key j + i's dot alone
      float* row = scores + r * keys_n;
      for (int64_t i = 0; i < std::min<int64_t>(8, visible[r] - j); ++i) row[j + i] = dots[i] * softmax_scale;
    }
  }
  float total[R];
  for (int r = 0; r < R; ++r) total[r] = exp_shifted(scores + r * keys_n, visible[r], 1.f);   // scaled already
  Vec16 acc[R][NV] = {};
  for (int64_t j = 0; j < last; ++j) {
    if (j + ahead < last) fetch_row<T, dim>(values + slots[j + ahead] * stride);
    const T* v_row = values + slots[j] * stride;
    for (int v = 0; v < NV; ++v) {
      const Vec16 value = load16(v_row + 16 * v);
      for (int r = 0; r < R; ++r)
        if (j < visible[r]) acc[r][v] += (Vec16{} + scores[r * keys_n + j]) * value;
    }
  }
  for (int r = 0; r < R; ++r) {
    const float norm = 1.f / total[r];
    float out[dim];
    for (int v = 0; v < NV; ++v) std::memcpy(out + 16 * v, &acc[r][v], sizeof(Vec16));
    for (int64_t d = 0; d < dim; ++d) out_rows[r0 + r][d] = round_to<T>(out[d] * norm);
  }
}

template <int NV, typename T>
void attend_in_registers(const float* const* query, int64_t n_rows, int64_t group, int64_t first,
                         const int64_t* slots, const T* kc, const T* vc, int64_t kv_heads, int64_t kv_head,
                         float softmax_scale, float* scores, int64_t keys_n, T* const* out_rows) {
  constexpr int R = NV <= 4 ? 2 : 1;
  const int64_t stride = kv_heads * NV * 16;
  const T* keys = kc + kv_head * NV * 16;
  const T* values = vc + kv_head * NV * 16;
  int64_t r = 0;
  for (; r + R <= n_rows; r += R)
    attend_rows<NV, R, T>(query, r, group, first, slots, keys, values, stride, softmax_scale, scores, keys_n, out_rows);
  for (; r < n_rows; ++r)
    attend_rows<NV, 1, T>(query, r, group, first, slots, keys, values, stride, softmax_scale, scores, keys_n, out_rows);
}

template <typename T>
void attention_impl(const at::Tensor& qkv, const Heads& heads, at::Tensor& k_cache, at::Tensor& v_cache,
                    const at::Tensor& q_start, const at::Tensor& q_len, const at::Tensor& kv_len,
                    const at::Tensor& rows, const at::Tensor& table, const at::Tensor& rope,
                    const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                    double norm_eps, double scale, at::Tensor& out, float* queries) {
  const int64_t tokens = qkv.size(0), seqs = q_start.size(0), dim = heads.dim;
  const int64_t qkv_stride = qkv.stride(0), num_slots = k_cache.size(0), width = table.size(1);
  const int64_t table_stride = table.stride(0);
  const int64_t group = heads.q / heads.kv;
  const T* src = qkv.data_ptr<T>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  const int64_t* qs = q_start.data_ptr<int64_t>();
  const int64_t* ql = q_len.data_ptr<int64_t>();
  const int64_t* kl = kv_len.data_ptr<int64_t>();
  const int64_t* rw = rows.data_ptr<int64_t>();
  const int64_t* tb = table.data_ptr<int64_t>();
  const float* cos_sin = rope.data_ptr<float>();
  const T* qn = q_norm ? q_norm->data_ptr<T>() : nullptr;
  const T* kn = k_norm ? k_norm->data_ptr<T>() : nullptr;
  const float eps = static_cast<float>(norm_eps);

  // Which sequence each token belongs to, its position, and the slot its key goes to.
  std::vector<int64_t> seq_of(tokens, -1), pos_of(tokens, 0);
  int64_t longest = 0;
  for (int64_t b = 0; b < seqs; ++b) {
    TORCH_CHECK(ql[b] >= 0 && ql[b] <= kl[b] && kl[b] <= width && qs[b] >= 0 && qs[b] + ql[b] <= tokens,
                "attention: sequence ", b, " has q_start ", qs[b], ", q_len ", ql[b], ", kv_len ", kl[b],
                " (", tokens, " tokens, table width ", width, ")");
    for (int64_t i = 0; i < ql[b]; ++i) {
      seq_of[qs[b] + i] = b;
      pos_of[qs[b] + i] = kl[b] - ql[b] + i;
    }
    longest = std::max(longest, kl[b]);
  }
  auto slot_at = [&](int64_t b, int64_t pos) {
    const int64_t slot = tb[rw[b] * table_stride + pos];
    TORCH_CHECK(slot >= 0 && slot < num_slots, "attention: slot ", slot, " outside the cache (", num_slots, " slots)");
    return slot;
  };

  T* dst = out.data_ptr<T>();

  // Each (sequence, kv head) at once, its jobs split across the threads. First its new tokens: their
  // queries of the `group` heads sharing the kv head rotated (kept in float32, in `queries` [T, H, D]),
  // the kv head's new keys rotated and written to the cache with their values: only this job reads
  // them, so one loop over the jobs does both passes (no barrier between). Then its queries (q_len
  // tokens x the group's heads) read each key and value row once; query row r = i * group + g sees
  // keys 0 ..= position(i).
  auto rotate_new = [&](int64_t b, int64_t kv_head, float* key) {
    for (int64_t t = qs[b]; t < qs[b] + ql[b]; ++t) {
      const T* row = src + t * qkv_stride;
      for (int64_t h = kv_head * group; h < (kv_head + 1) * group; ++h) {
        float* q = queries + (t * heads.q + h) * dim;
        for (int64_t d = 0; d < dim; ++d) q[d] = to_float(row[h * dim + d]);
        if (qn) head_norm(q, qn, dim, eps);
        rotate(q, cos_sin + t * dim, dim);
      }
      const int64_t slot = slot_at(b, pos_of[t]);
      const T* k_src = row + (heads.q + kv_head) * dim;
      const T* v_src = row + (heads.q + heads.kv + kv_head) * dim;
      for (int64_t d = 0; d < dim; ++d) key[d] = to_float(k_src[d]);
      if (kn) head_norm(key, kn, dim, eps);
      rotate(key, cos_sin + t * dim, dim);
      T* k_dst = kc + (slot * heads.kv + kv_head) * dim;
      T* v_dst = vc + (slot * heads.kv + kv_head) * dim;
      for (int64_t d = 0; d < dim; ++d) {
        k_dst[d] = round_to<T>(key[d]);
        v_dst[d] = v_src[d];
      }
    }
  };
  const float softmax_scale = static_cast<float>(scale);
  spread(0, seqs * heads.kv, 1, [&](int64_t begin, int64_t end) {
    if (begin == 0)                                  // tokens no sequence owns: zeros out (the first part's)
      for (int64_t t = 0; t < tokens; ++t)
        if (seq_of[t] < 0)
          for (int64_t d = 0; d < heads.q * dim; ++d) dst[t * heads.q * dim + d] = static_cast<T>(0.f);
    std::vector<float> scores, acc, key(dim);
    std::vector<int64_t> slots;
    std::vector<const float*> query;          // row r's query vector (token q_start + r / group, head r % group)
    std::vector<T*> out_rows;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / heads.kv, kv_head = job % heads.kv;
      const int64_t n_q = ql[b], keys = kl[b], first = keys - n_q, n_rows = n_q * group;
      if (n_q == 0) continue;
      rotate_new(b, kv_head, key.data());
      scores.assign(n_rows * keys, 0.f);
      acc.assign(n_rows * dim, 0.f);
      slots.resize(keys);
      for (int64_t j = 0; j < keys; ++j) slots[j] = slot_at(b, j);
      query.resize(n_rows);
      for (int64_t r = 0; r < n_rows; ++r)
        query[r] = queries + ((qs[b] + r / group) * heads.q + kv_head * group + r % group) * dim;
      out_rows.resize(n_rows);
      for (int64_t r = 0; r < n_rows; ++r)
        out_rows[r] = dst + ((qs[b] + r / group) * heads.q + kv_head * group + r % group) * dim;
      if (n_q > MAX_TOKENS_IN_REGISTERS) {
        attend_by_products(query.data(), n_rows, group, keys, first, slots.data(), kc, vc, heads.kv, kv_head, dim,
                           softmax_scale, out_rows.data());
        continue;
      }
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
        if (dim == 64 || dim == 128) {
          (dim == 64 ? attend_in_registers<4, T> : attend_in_registers<8, T>)(
              query.data(), n_rows, group, first, slots.data(), kc, vc, heads.kv, kv_head, softmax_scale,
              scores.data(), keys, out_rows.data());
          continue;
        }
      }
      for (int64_t j = 0; j < keys; ++j) {
        const T* k = kc + (slots[j] * heads.kv + kv_head) * dim;
        // rows of queries at positions >= j: all of them for j <= first, fewer for the new keys
        const int64_t from = j <= first ? 0 : (j - first) * group;
        for (int64_t r = from; r < n_rows; ++r) {
          const float* q = query[r];
          float dot = 0.f;
_Pragma("omp simd reduction(+ : dot)")
          for (int64_t d = 0; d < dim; ++d) dot += q[d] * to_float(k[d]);
          scores[r * keys + j] = dot * softmax_scale;
        }
      }
      for (int64_t r = 0; r < n_rows; ++r) {
        const int64_t visible = first + r / group + 1;
        float* row = scores.data() + r * keys;
        const float norm = 1.f / exp_shifted(row, visible, 1.f);
        for (int64_t j = 0; j < visible; ++j) row[j] *= norm;
      }
      for (int64_t j = 0; j < keys; ++j) {
        const T* v = vc + (slots[j] * heads.kv + kv_head) * dim;
        const int64_t from = j <= first ? 0 : (j - first) * group;
        for (int64_t r = from; r < n_rows; ++r) {
          const float p = scores[r * keys + j];
          float* a = acc.data() + r * dim;
_Pragma("omp simd")
          for (int64_t d = 0; d < dim; ++d) a[d] += p * to_float(v[d]);
        }
      }
      for (int64_t r = 0; r < n_rows; ++r)
        for (int64_t d = 0; d < dim; ++d) out_rows[r][d] = round_to<T>(acc[r * dim + d]);
    }
  });
}

// attention's arguments checked: qkv [T, (H + 2 Hkv) * D], the caches, lengths, table and rope.
void check_attention(const at::Tensor& qkv, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                     const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& q_start,
                     const at::Tensor& q_len, const at::Tensor& kv_len, const at::Tensor& rows,
                     const at::Tensor& table, const at::Tensor& rope) {
  check_cpu_rows(qkv, "qkv");
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim, "attention: qkv width ", qkv.size(1),
              " is not (", num_heads, " + 2 * ", num_kv_heads, ") * ", head_dim);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim % 2 == 0, "attention: bad head counts");
  for (const auto* cache : {&k_cache, &v_cache}) {
    TORCH_CHECK(cache->is_contiguous() && cache->dim() == 3 && cache->size(1) == num_kv_heads && cache->size(2) == head_dim &&
                cache->scalar_type() == qkv.scalar_type(), "attention: the KV cache must be contiguous [slots, ", num_kv_heads,
                ", ", head_dim, "] of the activations' dtype");
  }
  for (const auto* t : {&q_start, &q_len, &kv_len, &rows}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == q_start.numel(), "attention: lengths must be int64 [B]");
  }
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.stride(1) == 1,
              "attention: table must be int64 [rows, width] with unit stride along the width");
  TORCH_CHECK(rope.scalar_type() == at::kFloat && rope.is_contiguous() && rope.dim() == 2 && rope.size(0) == qkv.size(0) &&
              rope.size(1) == head_dim, "attention: rope must be float32 [T, head_dim] (rope_table)");
  const int64_t seqs = rows.numel();
  const int64_t* rw = rows.data_ptr<int64_t>();
  for (int64_t b = 0; b < seqs; ++b) TORCH_CHECK(rw[b] >= 0 && rw[b] < table.size(0), "attention: row ", rw[b], " outside the table");
}

// qkv [T, (H + 2 Hkv) * D] (the stacked projection's output); returns [T, H * D].
at::Tensor attention(const at::Tensor& qkv, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                     at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& q_start, const at::Tensor& q_len,
                     const at::Tensor& kv_len, const at::Tensor& rows, const at::Tensor& table,
                     const at::Tensor& rope, const c10::optional<at::Tensor>& q_norm,
                     const c10::optional<at::Tensor>& k_norm, double norm_eps, double scale) {
  check_attention(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, q_start, q_len, kv_len, rows, table, rope);
  auto out = at::empty({qkv.size(0), num_heads * head_dim}, qkv.options());
  auto queries = at::empty({qkv.size(0) * num_heads * head_dim}, qkv.options().dtype(at::kFloat));
  const Heads heads{num_heads, num_kv_heads, head_dim};
  c10::optional<at::Tensor> qn, kn;
  if (q_norm) qn = q_norm->contiguous();
  if (k_norm) kn = k_norm->contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "attention", [&] {
    attention_impl<scalar_t>(qkv, heads, k_cache, v_cache, q_start, q_len, kv_len, rows, table, rope, qn, kn,
                             norm_eps, scale, out, queries.data_ptr<float>());
  });
  return out;
}

// y [M, N] = x [M, K] @ (W * scale)^T (+ bias): weight-only int8, one scale per output channel, for
// a few rows (decode, verify, draft steps) where reading the weights is the cost: a quarter of the
// bytes of float32. W is packed [N / 64, K, 64] (int8_pack in engine/models/quant.py): 64 output
// channels side by side, so the products run along the outputs with no horizontal sums, and the
// weights stream through once per four rows of x.
constexpr int64_t PACK = 64;

template <int R, typename T>
void int8_block(const float* x, int64_t k_dim, const int8_t* w, const float* scale, const T* bias, T* y,
                int64_t n_dim, int64_t n0) {
  float acc[R][PACK] = {};
  for (int64_t k = 0; k < k_dim; ++k) {
    const int8_t* wk = w + k * PACK;
    for (int r = 0; r < R; ++r) {
      const float xr = x[r * k_dim + k];
_Pragma("omp simd")
      for (int64_t j = 0; j < PACK; ++j) acc[r][j] += xr * static_cast<float>(wk[j]);
    }
  }
  const int64_t width = std::min(PACK, n_dim - n0);
  for (int r = 0; r < R; ++r) {
    for (int64_t j = 0; j < width; ++j) {
      const float add = bias ? to_float(bias[n0 + j]) : 0.f;
      y[r * n_dim + n0 + j] = round_to<T>(acc[r][j] * scale[n0 + j] + add);
    }
  }
}

at::Tensor int8_linear(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 3 && packed.size(2) == PACK && packed.is_contiguous(),
              "int8_linear: weight must be packed contiguous int8 [N / 64, K, 64]");
  const int64_t k_dim = packed.size(1), n_dim = scale.numel();
  TORCH_CHECK(x_in.size(-1) == k_dim, "int8_linear: input width ", x_in.size(-1), " != weight's ", k_dim);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && n_dim <= packed.size(0) * PACK &&
              n_dim > (packed.size(0) - 1) * PACK, "int8_linear: scale must be float32 [N] for the packed blocks");
  const auto x = x_in.reshape({-1, k_dim}).to(at::kFloat).contiguous();
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = n_dim;
  auto y = at::empty({x.size(0), n_dim}, x_in.options());
  c10::optional<at::Tensor> b;
  if (bias) {
    TORCH_CHECK(bias->numel() == n_dim && bias->scalar_type() == x_in.scalar_type(), "int8_linear: bias must be [N] of the input's dtype");
    b = bias->contiguous();
  }
  const int64_t rows = x.size(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x_in.scalar_type(), "int8_linear", [&] {
    const float* xp = x.data_ptr<float>();
    const int8_t* wp = packed.data_ptr<int8_t>();
    const float* sp = scale.data_ptr<float>();
    const scalar_t* bp = b ? b->data_ptr<scalar_t>() : nullptr;
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) {
      for (int64_t blk = begin; blk < end; ++blk) {
        const int8_t* wb = wp + blk * k_dim * PACK;
        int64_t m = 0;
        for (; m + 4 <= rows; m += 4) int8_block<4>(xp + m * k_dim, k_dim, wb, sp, bp, yp + m * n_dim, n_dim, blk * PACK);
        for (; m + 2 <= rows; m += 2) int8_block<2>(xp + m * k_dim, k_dim, wb, sp, bp, yp + m * n_dim, n_dim, blk * PACK);
        for (; m < rows; ++m) int8_block<1>(xp + m * k_dim, k_dim, wb, sp, bp, yp + m * n_dim, n_dim, blk * PACK);
      }
    });
  });
  return y.view(out_shape);
}

// The packed int8 weight back as a [N, K] matrix of `dtype` (W * scale), in one pass: for products of
// many rows (prompt chunks), where torch's compute-bound product beats int8_linear.
at::Tensor int8_dequantize(const at::Tensor& packed, const at::Tensor& scale, at::ScalarType dtype) {
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 3 && packed.size(2) == PACK && packed.is_contiguous(),
              "int8_dequantize: weight must be packed contiguous int8 [N / 64, K, 64]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous(), "int8_dequantize: scale must be float32 [N]");
  const int64_t k_dim = packed.size(1), n_dim = scale.numel();
  auto out = at::empty({n_dim, k_dim}, packed.options().dtype(dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "int8_dequantize", [&] {
    const int8_t* wp = packed.data_ptr<int8_t>();
    const float* sp = scale.data_ptr<float>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, n_dim, 16, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const int8_t* w = wp + (n / PACK) * k_dim * PACK + n % PACK;
        const float sn = sp[n];
        for (int64_t k = 0; k < k_dim; ++k) op[n * k_dim + k] = static_cast<scalar_t>(static_cast<float>(w[k * PACK]) * sn);
      }
    });
  });
  return out;
}

// y [M, N] = x [M, K] @ W^T (+ bias) for a float32 weight W [N, K] and a few rows of x (decode,
// verify, draft steps): reading W is the cost, and torch's product reads it at a fraction of the
// memory bandwidth there (MKL's small-M path: bench/cpu_linear.py). Eight rows of W stream side by
// side, each against one or two rows of x at a time in 16-float vectors (AVX-512 where the build has
// it, two AVX2 halves otherwise); a block of W is read from memory once for all rows of x. Each
// output is the same sum in the same order whatever the number of rows: a row's logits do not
// depend on the batch it came in.
constexpr int64_t FLOAT_LINEAR_MAX_ROWS = 64;      // above: torch's compute-bound product
constexpr int64_t FLOAT_BLOCK = 8;                 // rows of W a block
// `next`: the block of W after this one (or null), fetched line by line alongside this one's, into
// the outer caches (prefetcht2): the eight row streams of a block are too short for the hardware
// prefetcher to follow. Measured on the model's products side by side: 0.70x the time at 1 and 4
// rows, 0.95x at 32-64; a fetch into L1 gained half as much, and at 64 rows lost (the next block
// evicted the one the later row pairs re-read).
template <int R>
void product_block(const float* x, int64_t k_dim, const float* w, int64_t nb, const float* bias, float* y,
                 int64_t n_dim, const float* next) {
  Vec16 acc[R][FLOAT_BLOCK] = {};
  int64_t k = 0;
  for (; k + 16 <= k_dim; k += 16) {
    if (next)
      for (int64_t j = 0; j < FLOAT_BLOCK; ++j) __builtin_prefetch(next + j * k_dim + k, 0, 1);
    Vec16 wv[FLOAT_BLOCK];
    for (int64_t j = 0; j < FLOAT_BLOCK; ++j) wv[j] = j < nb ? load16(w + j * k_dim + k) : Vec16{};
    for (int r = 0; r < R; ++r) {
      const Vec16 xv = load16(x + r * k_dim + k);
      for (int64_t j = 0; j < FLOAT_BLOCK; ++j) acc[r][j] += xv * wv[j];
    }
  }
  for (int r = 0; r < R; ++r) {
    const Vec8 sums = sum_lanes8(acc[r]);
    for (int64_t j = 0; j < nb; ++j) {
      float s = sums[j];
      for (int64_t kk = k; kk < k_dim; ++kk) s += x[r * k_dim + kk] * w[j * k_dim + kk];
      y[r * n_dim + j] = bias ? s + bias[j] : s;
    }
  }
}

// Off: every float product through torch (bench/cpu_kernels.py measures both side by side).
std::atomic<bool> float_products_enabled{true};

void set_native_float_products(bool enabled) { float_products_enabled = enabled; }

// Off: no block of W fetched ahead (product_block's `next`; benchmarks measure both).
std::atomic<bool> float_prefetch_enabled{true};

void set_float_prefetch(bool enabled) { float_prefetch_enabled = enabled; }

bool native_float_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return float_products_enabled && x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
         weight.dim() == 2 && weight.is_contiguous() && x.size(-1) == weight.size(1) &&
         x.numel() / weight.size(1) <= FLOAT_LINEAR_MAX_ROWS &&
         (!bias || (bias->scalar_type() == at::kFloat && bias->numel() == weight.size(0)));
}

// The same product for bfloat16 weights and inputs, where the CPU multiplies bf16 pairs natively
// (AVX512-BF16's vdpbf16ps: 32 products a vector, summed in float32): half the bytes of float32 to
// read. The blocks, the fetch ahead and the fixed order of each output's sum are the float32
// product's; the output is the float32 sum rounded to bf16 once. Built only where the compiler
// targets such a CPU (HAS_BF16_PRODUCT).
#if defined(__AVX512BF16__)
constexpr bool HAS_BF16_PRODUCT = true;

template <int R>
void product_block(const c10::BFloat16* x, int64_t k_dim, const c10::BFloat16* w, int64_t nb, const c10::BFloat16* bias,
                c10::BFloat16* y, int64_t n_dim, const c10::BFloat16* next) {
  __m512 acc[R][FLOAT_BLOCK];
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < FLOAT_BLOCK; ++j) acc[r][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= k_dim; k += 32) {
    if (next)
      for (int64_t j = 0; j < FLOAT_BLOCK; ++j) __builtin_prefetch(next + j * k_dim + k, 0, 1);
    __m512bh wv[FLOAT_BLOCK];
    for (int64_t j = 0; j < FLOAT_BLOCK; ++j)
      wv[j] = j < nb ? (__m512bh)_mm512_loadu_si512(w + j * k_dim + k) : (__m512bh)_mm512_setzero_si512();
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * k_dim + k);
      for (int64_t j = 0; j < FLOAT_BLOCK; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    Vec16 lanes[FLOAT_BLOCK];
    for (int64_t j = 0; j < FLOAT_BLOCK; ++j) lanes[j] = (Vec16)acc[r][j];
    const Vec8 sums = sum_lanes8(lanes);
    for (int64_t j = 0; j < nb; ++j) {
      float s = sums[j];
      for (int64_t kk = k; kk < k_dim; ++kk) s += static_cast<float>(x[r * k_dim + kk]) * static_cast<float>(w[j * k_dim + kk]);
      y[r * n_dim + j] = round_to<c10::BFloat16>(bias ? s + to_float(bias[j]) : s);
    }
  }
}

#else
constexpr bool HAS_BF16_PRODUCT = false;
#endif

bool native_bf16_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return HAS_BF16_PRODUCT && float_products_enabled && x.scalar_type() == at::kBFloat16 &&
         weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 && weight.is_contiguous() &&
         x.size(-1) == weight.size(1) && x.numel() / weight.size(1) <= FLOAT_LINEAR_MAX_ROWS &&
         (!bias || (bias->scalar_type() == at::kBFloat16 && bias->numel() == weight.size(0)));
}

// What a product y = x @ W^T (+ b) of N outputs over K inputs works on: x as [M, K] rows, y [M, N]
// to fill, the bias made contiguous, and the shape y takes back (x's leading dimensions, then N).
struct ProductOperands {
  at::Tensor x, y, bias;
  std::vector<int64_t> out_shape;
};

ProductOperands product_operands(const at::Tensor& x_in, int64_t k_dim, int64_t n_dim,
                                 const c10::optional<at::Tensor>& bias) {
  ProductOperands ops;
  ops.x = x_in.reshape({-1, k_dim}).contiguous();
  ops.out_shape.assign(x_in.sizes().begin(), x_in.sizes().end());
  ops.out_shape.back() = n_dim;
  ops.y = at::empty({ops.x.size(0), n_dim}, ops.x.options());
  if (bias) ops.bias = bias->contiguous();
  return ops;
}

// The products on AMX's tile units, where the CPU has them: bf16 (amx_bf16, packed_product) and int8
// (amx_int8, w8a8_linear). W is packed once at load into 1 KB blocks of 16 output columns, each the B
// operand of one tile multiply (16 rows of 64 bytes: 32 bf16 pairs or 64 int8 quads of a column),
// the blocks of 16 columns one after another along K. A tile multiply sums 16 x 32 bf16 products per
// row where vdpbf16ps sums 32 (measured in-process on the model's five shapes, 2 threads: 0.5-0.7x the
// time of the vdpbf16ps product below at 1 row, 0.15-0.25x at 8, and near torch's oneDNN at 512). They
// run at every number of rows, so a row's sums never depend on the batch (no switch to torch's product
// above some rows): row m of C is C[m] += A[m] . B, kb after kb, the same instructions whatever rows
// share its tile. A weight takes this path only in its packed form, so every call with one weight sums
// the same way. Built where the compiler targets such a CPU; used where the kernel grants the process
// the tile state (arch_prctl, Linux 5.16+). Without tiles, the same packed blocks are read by vectors
// (AVX512-VNNI for int8: w8_vnni_pass; AVX512-BF16 for bf16: bf16_vector_pass), at every row count too.
constexpr int64_t TILE_ROWS = 16, TILE_COLS = 16;   // rows of x a pass, output columns a block
constexpr int64_t TILE_GROUP = 4;                    // C tiles a pass: 64 output columns against one A tile

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
constexpr bool HAS_TILE_PRODUCT = true;

struct TileConfig {              // LDTILECFG's 64-byte layout (palette 1)
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool tiles_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
}

// Tiles 0..3: C (m rows x 16 sums); 4: A (m rows x 64 bytes of x); 5, 6: B blocks, alternating.
void tile_config(int64_t m) {
  TileConfig config;
  for (int t = 0; t <= 4; ++t) config.rows[t] = m, config.colsb[t] = 64;
  for (int t = 5; t <= 6; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  _tile_loadconfig(&config);
}
void tile_release() { _tile_release(); }

// The two tile multiplies: what a row of A holds (K inputs in 64 bytes) and what C sums in.
struct Bf16Tiles {
  using In = c10::BFloat16;
  using Sum = float;
  static constexpr int64_t K = 32;
  static constexpr bool INT8 = false;
};
#if defined(__AMX_INT8__)
constexpr bool HAS_INT8_TILES = true;
struct Int8Tiles {
  using In = int8_t;
  using Sum = int32_t;
  static constexpr int64_t K = 64;
  static constexpr bool INT8 = true;
};
#else
constexpr bool HAS_INT8_TILES = false;
#endif

// C tile c += A (tile 4) . B tile b, in the multiply of Tiles (the intrinsics take literal tile numbers).
#define TILE_MULTIPLY(c, b)                                  \
  do {                                                       \
    if constexpr (Tiles::INT8) _tile_dpbssd(c, 4, b);        \
    else _tile_dpbf16ps(c, 4, b);                            \
  } while (0)

// The sums of m rows of x (width x_width, m set by tile_config) against NB blocks of 16 columns from
// block n_block: c [m][TILE_GROUP * 16].
template <class Tiles, int NB>
void tile_pass(const typename Tiles::In* x, int64_t x_width, const typename Tiles::In* w, int64_t n_block,
               typename Tiles::Sum* c) {
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (NB > 2) _tile_zero(2);
  if constexpr (NB > 3) _tile_zero(3);
  constexpr int64_t block = TILE_COLS * Tiles::K;
  const int64_t k_blocks = x_width / Tiles::K, column_stride = k_blocks * block;
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    _tile_loadd(4, x + kb * Tiles::K, x_width * sizeof(typename Tiles::In));
    const typename Tiles::In* b = w + n_block * column_stride + kb * block;
    _tile_loadd(5, b, 64);
    TILE_MULTIPLY(0, 5);
    if constexpr (NB > 1) { _tile_loadd(6, b + column_stride, 64); TILE_MULTIPLY(1, 6); }
    if constexpr (NB > 2) { _tile_loadd(5, b + 2 * column_stride, 64); TILE_MULTIPLY(2, 5); }
    if constexpr (NB > 3) { _tile_loadd(6, b + 3 * column_stride, 64); TILE_MULTIPLY(3, 6); }
  }
  constexpr int64_t ldc = TILE_GROUP * TILE_COLS * 4;
  _tile_stored(0, c, ldc);
  if constexpr (NB > 1) _tile_stored(1, c + TILE_COLS, ldc);
  if constexpr (NB > 2) _tile_stored(2, c + 2 * TILE_COLS, ldc);
  if constexpr (NB > 3) _tile_stored(3, c + 3 * TILE_COLS, ldc);
}
#else
constexpr bool HAS_TILE_PRODUCT = false, HAS_INT8_TILES = false;
bool tiles_granted() { return false; }
void tile_config(int64_t) {}
void tile_release() {}
#endif

// f(std::integral_constant<int, n>) for n = 1..4: the passes' block and row counts as template arguments.
template <typename F>
void with_count(int64_t n, const F& f) {
  switch (n) {
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{});
  }
}

// Off: the float vector passes read four rows at a time whatever the count (benchmarks measure both).
std::atomic<bool> wide_row_runs_enabled{true};

void set_wide_row_runs(bool enabled) { wide_row_runs_enabled = enabled; }

// run(R, r) over the rows [0, m) of a vector pass: four at a time, or all at once where m is 5 or 6, a
// verify run of 4-5 drafts and its bonus token: their sums, the weight vectors and the broadcast input
// still fit the 32 vector registers, and the weights are read once, not for four rows and again for the
// rest. A row's sums are the same either way. A verify forward in-process, in one process against four
// rows at a time (an AMD EPYC): bf16 0.93x the time at 5 tokens and 0.96x at 6, float32 0.93x and 0.91x,
// 1 token level. Not for W8A8 on VNNI, whose first run also sums the columns: 5 rows at once took 1.11x.
template <typename Run>
void in_row_runs(int64_t m, const Run& run) {
  if (wide_row_runs_enabled && m == 5) return run(std::integral_constant<int, 5>{}, 0);
  if (wide_row_runs_enabled && m == 6) return run(std::integral_constant<int, 6>{}, 0);
  for (int64_t r = 0; r < m; r += 4)
    with_count(std::min<int64_t>(4, m - r), [&](auto rows) { run(rows, r); });
}

// The loop of a blocked product: rows in blocks of TILE_ROWS against groups of TILE_GROUP column
// blocks, the groups split across the threads (a thread reads only its own columns of W).
// pass(NB, m0, m, first, c) leaves in c [m][64] the sums of rows m0 .. m0 + m against blocks first ..
// first + NB; store(m0, m, first, nb, c) writes them out. With tiles, each thread configures its own.
template <typename Sum, typename Pass, typename Store>
void blocked_product(int64_t rows, int64_t n_blocks, bool tiles, const Pass& pass, const Store& store) {
  const int64_t groups = (n_blocks + TILE_GROUP - 1) / TILE_GROUP;
  spread(0, groups, 1, [&](int64_t begin, int64_t end) {
    alignas(64) Sum c[TILE_ROWS * TILE_GROUP * TILE_COLS];
    for (int64_t m0 = 0; m0 < rows; m0 += TILE_ROWS) {
      const int64_t m = std::min(TILE_ROWS, rows - m0);
      if (tiles) tile_config(m);
      for (int64_t g = begin; g < end; ++g) {
        const int64_t first = g * TILE_GROUP, nb = std::min(TILE_GROUP, n_blocks - first);
        with_count(nb, [&](auto blocks) { pass(blocks, m0, m, first, c); });
        store(m0, m, first, nb, c);
      }
    }
    if (tiles) tile_release();
  });
}

// Where the CPU multiplies bf16 pairs (AVX512-BF16) but grants no AMX tiles, the packed blocks are
// read by vectors as they are: a block's row p (64 bytes) is the input pair 2p, 2p + 1 of its 16
// columns, one vdpbf16ps against that pair of x broadcast, 16 output sums side by side (none summed
// across lanes at the end, as few_row_product's are). R rows of x against NB blocks: each vector of W
// is loaded once for R rows. A column's sum is its pairs in order, whatever rows are read with it.
// On an AMD EPYC (bench/cpu_linear.py, the model's five shapes, 2 threads): 0.52-0.93x
// few_row_product's time at 1 row, 0.59-0.75x at 4, 0.48-0.75x at 16-64, and level with torch's
// oneDNN bf16 product at 512 rows (0.88-1.07x).
#if defined(__AVX512BF16__)
constexpr int64_t BF16_PAIRS = 16, BF16_BLOCK = TILE_COLS * 2 * BF16_PAIRS;   // a block: 32 inputs of 16 columns

template <int NB, int R>
void bf16_vector_rows(const c10::BFloat16* x, int64_t k_dim, const c10::BFloat16* w, int64_t column_stride, float* c) {
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int nb = 0; nb < NB; ++nb) acc[r][nb] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < k_dim / (2 * BF16_PAIRS); ++kb)
    for (int p = 0; p < BF16_PAIRS; ++p) {
      const c10::BFloat16* wk = w + kb * BF16_BLOCK + p * 2 * TILE_COLS;
      __m512bh b[NB];
      for (int nb = 0; nb < NB; ++nb) b[nb] = (__m512bh)_mm512_loadu_si512(wk + nb * column_stride);
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * k_dim + kb * 2 * BF16_PAIRS + 2 * p, 4);
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
        for (int nb = 0; nb < NB; ++nb) acc[r][nb] = _mm512_dpbf16_ps(acc[r][nb], a, b[nb]);
      }
    }
  for (int r = 0; r < R; ++r)
    for (int nb = 0; nb < NB; ++nb) _mm512_storeu_ps(c + r * TILE_GROUP * TILE_COLS + nb * TILE_COLS, acc[r][nb]);
}

// The float sums of rows [0, m) of x against NB blocks from block n_block, c [m][64] (in_row_runs).
template <int NB>
void bf16_vector_pass(const c10::BFloat16* x, int64_t m, int64_t k_dim, const c10::BFloat16* w, int64_t n_block,
                      float* c) {
  const int64_t column_stride = k_dim / (2 * BF16_PAIRS) * BF16_BLOCK;
  in_row_runs(m, [&](auto rows, int64_t r) {
    bf16_vector_rows<NB, decltype(rows)::value>(x + r * k_dim, k_dim, w + n_block * column_stride, column_stride,
                                                c + r * TILE_GROUP * TILE_COLS);
  });
}
#endif

// float32 weights packed the same way where the CPU has AVX-512: [N/16, K, 16], packed[nb][k][c] =
// W[16 nb + c][k]. Each 64-byte row of a block is input k of its 16 columns, met by x[k] broadcast in
// one FMA: 16 output sums side by side, none summed across lanes at the end as few_row_product's are,
// each weight vector loaded once for four rows, the blocks read front to back. A column's sum is its
// inputs in order whatever rows are read with it, and it runs at every row count, so a row's sums never
// depend on its batch. On an AMD EPYC (the model's five shapes, 2 threads, against few_row_product):
// 0.86-0.92x the time at 1 row, 0.71-0.82x at 4, 0.63-0.82x at 16, 0.69-0.93x at 64, and level with
// torch's product at 512 rows (0.98-1.04x; 0.83x on the LM head's shape).
#if defined(__AVX512F__)
constexpr bool HAS_F32_PACKED = true;

template <int NB, int R>
void f32_vector_rows(const float* x, int64_t k_dim, const float* w, int64_t column_stride, float* c) {
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int nb = 0; nb < NB; ++nb) acc[r][nb] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_dim; ++k) {
    __m512 b[NB];
    for (int nb = 0; nb < NB; ++nb) b[nb] = _mm512_loadu_ps(w + nb * column_stride + k * TILE_COLS);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * k_dim + k]);
      for (int nb = 0; nb < NB; ++nb) acc[r][nb] = _mm512_fmadd_ps(a, b[nb], acc[r][nb]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int nb = 0; nb < NB; ++nb) _mm512_storeu_ps(c + r * TILE_GROUP * TILE_COLS + nb * TILE_COLS, acc[r][nb]);
}

// The float sums of rows [0, m) of x against NB blocks from block n_block, c [m][64] (in_row_runs).
template <int NB>
void f32_vector_pass(const float* x, int64_t m, int64_t k_dim, const float* w, int64_t n_block, float* c) {
  const int64_t column_stride = k_dim * TILE_COLS;
  in_row_runs(m, [&](auto rows, int64_t r) {
    f32_vector_rows<NB, decltype(rows)::value>(x + r * k_dim, k_dim, w + n_block * column_stride, column_stride,
                                               c + r * TILE_GROUP * TILE_COLS);
  });
}
#else
constexpr bool HAS_F32_PACKED = false;
#endif

#if defined(__AVX512F__)
// blocked_product's store for the packed float products: the float sums c of rows m0 .. m0 + m against
// blocks first .. first + nb go to y [M, n_dim] (T: float32 or bf16), plus the bias, rounded to T once.
template <typename T>
auto float_sums_store(T* y, const T* bias, int64_t n_dim) {
  return [=](int64_t m0, int64_t m, int64_t first, int64_t nb, const float* c) {
    const int64_t n0 = first * TILE_COLS, width = nb * TILE_COLS;
    for (int64_t r = 0; r < m; ++r) {
      T* out = y + (m0 + r) * n_dim + n0;
      const float* sums = c + r * TILE_GROUP * TILE_COLS;
      for (int64_t j = 0; j < width; j += 16) {      // width: whole blocks of 16
        const __m512 v = _mm512_loadu_ps(sums + j);
        store_ps(out + j, bias ? _mm512_add_ps(v, load_ps(bias + n0 + j)) : v);
      }
    }
  };
}
#endif

// Whether bf16 weights run packed (tile_pack): on AMX tiles where built and granted, else on
// AVX512-BF16 vectors where built.
bool bf16_tiles_run() { return HAS_TILE_PRODUCT && tiles_granted(); }
bool bf16_packed_run() { return bf16_tiles_run() || HAS_BF16_PRODUCT; }
std::string bf16_packed_products() {
  return bf16_tiles_run() ? "AMX tiles" : HAS_BF16_PRODUCT ? "AVX512-BF16 vectors" : "";
}

// y [rows, N] = x [rows, K] . W (+ bias) for a bf16 weight in the packed bf16 form, on raw rows.
void packed_into(const c10::BFloat16* xp, int64_t rows, const at::Tensor& packed, const c10::BFloat16* bp,
                       c10::BFloat16* yp) {
#if defined(__AVX512BF16__)
  const int64_t n_blocks = packed.size(0), k_dim = packed.size(1) * 2 * BF16_PAIRS, n_dim = n_blocks * TILE_COLS;
  const auto* wp = packed.data_ptr<c10::BFloat16>();
  const bool tiles = bf16_tiles_run();
  blocked_product<float>(
      rows, n_blocks, tiles,
      [&](auto blocks, int64_t m0, int64_t m, int64_t first, float* c) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
        if (tiles) return tile_pass<Bf16Tiles, decltype(blocks)::value>(xp + m0 * k_dim, k_dim, wp, first, c);
#endif
        bf16_vector_pass<decltype(blocks)::value>(xp + m0 * k_dim, m, k_dim, wp, first, c);
      },
      float_sums_store(yp, bp, n_dim));
#else
  TORCH_CHECK(false, "packed_product: built without AVX512-BF16");
#endif
}

// y [rows, N] = x [rows, K] . W (+ bias) for a float32 weight in the packed float32 form, on raw rows.
void packed_into(const float* xp, int64_t rows, const at::Tensor& packed, const float* bp, float* yp) {
#if defined(__AVX512F__)
  const int64_t n_blocks = packed.size(0), k_dim = packed.size(1), n_dim = n_blocks * TILE_COLS;
  const float* wp = packed.data_ptr<float>();
  blocked_product<float>(
      rows, n_blocks, false,
      [&](auto blocks, int64_t m0, int64_t m, int64_t first, float* c) {
        f32_vector_pass<decltype(blocks)::value>(xp + m0 * k_dim, m, k_dim, wp, first, c);
      },
      float_sums_store(yp, bp, n_dim));
#else
  TORCH_CHECK(false, "packed_product: built without AVX-512");
#endif
}

// The inputs K of a packed weight: bf16 [N/16, K/32, 16, 16, 2], float32 [N/16, K, 16].
int64_t packed_inputs(const at::Tensor& packed) {
  return packed.scalar_type() == at::kFloat ? packed.size(1) : packed.size(1) * 32;
}

// x [..., K] . W (+ bias) as tensors, for a weight packed for T's passes (bf16: AMX tiles or AVX512-BF16
// vectors; float32: AVX-512 vectors).
template <typename T>
at::Tensor packed_product(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  const auto ops = product_operands(x_in, packed_inputs(packed), packed.size(0) * TILE_COLS, bias);
  packed_into(ops.x.data_ptr<T>(), ops.x.size(0), packed, bias ? ops.bias.data_ptr<T>() : nullptr, ops.y.data_ptr<T>());
  return ops.y.view(ops.out_shape);
}

// A weight in the packed bf16 form: [N/16, K/32, 16 input pairs, 16 columns, 2] bf16.
bool is_tile_packed(const at::Tensor& w) {
  return w.dim() == 5 && w.size(2) == 16 && w.size(3) == 16 && w.size(4) == 2 && w.scalar_type() == at::kBFloat16;
}

// A float32 weight in the packed float32 form: [N/16, K, 16 columns].
bool is_f32_packed(const at::Tensor& w) {
  return w.dim() == 3 && w.size(2) == 16 && w.scalar_type() == at::kFloat;
}

// W [N, K] packed for the vector or tile products where they run (the native products on, N a multiple
// of 16): bf16 in the packed bf16 form where bf16 pairs multiply (AMX tiles or AVX512-BF16; K a
// multiple of 32), float32 in the packed float32 form where the CPU has AVX-512; else W itself, for the
// other products. A stack [E, N, K] (MoE experts) packs each matrix: its [e] is expert e's packed weight.
at::Tensor tile_pack(const at::Tensor& w) {
  const int64_t n = w.dim() >= 2 ? w.size(-2) : 0, k = w.dim() >= 2 ? w.size(-1) : 0;
  const bool shaped = float_products_enabled && (w.dim() == 2 || w.dim() == 3) && n % 16 == 0 && n > 0 && k > 0;
  if (shaped && HAS_F32_PACKED && w.scalar_type() == at::kFloat) {
    // packed[nb][k][c] = W[16 nb + c][k]
    if (w.dim() == 3) return w.contiguous().view({w.size(0), n / 16, 16, k}).permute({0, 1, 3, 2}).contiguous();
    return w.contiguous().view({n / 16, 16, k}).permute({0, 2, 1}).contiguous();
  }
  if (!shaped || !bf16_packed_run() || w.scalar_type() != at::kBFloat16 || k % 32 != 0) return w;
  // packed[nb][kb][p][c][e] = W[16 nb + c][32 kb + 2 p + e]
  if (w.dim() == 3)
    return w.contiguous().view({w.size(0), n / 16, 16, k / 32, 16, 2}).permute({0, 1, 3, 4, 2, 5}).contiguous();
  return w.contiguous().view({n / 16, 16, k / 32, 16, 2}).permute({0, 2, 3, 1, 4}).contiguous();
}

// The [N, K] matrix of a packed weight.
at::Tensor tile_unpack(const at::Tensor& packed) {
  if (is_f32_packed(packed)) return packed.permute({0, 2, 1}).reshape({packed.size(0) * 16, packed.size(1)});
  TORCH_CHECK(is_tile_packed(packed), "tile_unpack: not a packed weight");
  return packed.permute({0, 3, 1, 2, 4}).reshape({packed.size(0) * 16, packed.size(1) * 32});
}

// ---- W8A8: int8 weights against int8 activations (--quantization w8a8_int8) ----
// W is packed [N/16, K/64, 16, 16, 4] int8 (engine/models/quant.py: w8a8_pack, N and K zero-padded):
// packed[nb][kb][p][c][e] = W[16 nb + c][64 kb + 4 p + e], each [nb][kb] block the B operand of one
// AMX tdpbssd. Each row of x is quantized on its own (quantize_rows: scale max |x| / 127, rounded half
// to even, as torch.round), the products sum in int32, exactly, and y = float(sum) * x_scale[row] *
// w_scale[n] (+ bias). Exact sums make every way of running it (tiles, the plain loop, any batch) give
// a row the same values: verify runs keep their decode steps' tokens with no care for the order of sums.
constexpr int64_t W8_K = 64, W8_BLOCK = TILE_COLS * W8_K;    // inputs a block, int8s of a B block

bool is_w8a8_packed(const at::Tensor& w) {
  return w.dim() == 5 && w.size(2) == 16 && w.size(3) == 16 && w.size(4) == 4 && w.scalar_type() == at::kChar;
}

// x [M, K] -> q [M, k_padded] int8 (zeros past K) and scale [M]: q = round(x * (127 / top)), scale =
// top / 127, top = max |x| (at least 1e-12). A multiply by the reciprocal, not a division per value
// (vdivps was most of a 16-row quantization), rounded by nearbyint (half to even, as torch.round; one
// vector instruction).
template <typename T>
void quantize_row(const T* x, int64_t k_dim, int8_t* q, float* scale) {
  int64_t k = 0;
  float amax = 0.f;
#if defined(__AVX512F__)
  if constexpr (VECTOR_TYPE<T>) {
    __m512 top = _mm512_setzero_ps();
    for (; k + 16 <= k_dim; k += 16) top = _mm512_max_ps(top, _mm512_abs_ps(load_ps(x + k)));
    amax = _mm512_reduce_max_ps(top);
  }
#endif
  for (; k < k_dim; ++k) amax = std::max(amax, std::fabs(to_float(x[k])));
  const float top = std::max(amax, 1e-12f), inv = 127.f / top;
  k = 0;
#if defined(__AVX512F__)
  if constexpr (VECTOR_TYPE<T>) {      // |x * inv| rounds to at most 127: the saturating narrowing clamps nothing
    const __m512 by = _mm512_set1_ps(inv);
    for (; k + 16 <= k_dim; k += 16) {
      const __m512i r = _mm512_cvt_roundps_epi32(_mm512_mul_ps(load_ps(x + k), by),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtsepi32_epi8(r));
    }
  }
#endif
  for (; k < k_dim; ++k) {
    const float v = std::nearbyint(to_float(x[k]) * inv);
    q[k] = static_cast<int8_t>(static_cast<int32_t>(std::min(127.f, std::max(-127.f, v))));
  }
  *scale = top / 127.f;
}

template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k_dim, int64_t k_padded, int8_t* q, float* scale,
                   bool alone = false) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(k_dim, 1));   // threads for prompts only
  row_loop(rows, grain, alone, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      quantize_row(x + r * k_dim, k_dim, q + r * k_padded, scale + r);
      std::memset(q + r * k_padded + k_dim, 0, k_padded - k_dim);
    }
  });
}

// Without int8 tiles: the int32 sums of rows [0, m) of xq against NB blocks of 16 columns from block
// n_block, c [m][64], one row at a time (the same exact sums).
template <int NB>
void w8_plain_pass(const int8_t* xq, int64_t m, int64_t k_padded, const int8_t* w, int64_t n_block, int32_t* c) {
  const int64_t k_blocks = k_padded / W8_K, column_stride = k_blocks * W8_BLOCK;
  for (int64_t r = 0; r < m; ++r) {
    int32_t acc[NB][TILE_COLS] = {};
    const int8_t* xr = xq + r * k_padded;
    for (int64_t kb = 0; kb < k_blocks; ++kb) {
      for (int nb = 0; nb < NB; ++nb) {
        const int8_t* b = w + (n_block + nb) * column_stride + kb * W8_BLOCK;
        for (int64_t p = 0; p < W8_K / 4; ++p)
          for (int64_t e = 0; e < 4; ++e) {
            const int32_t xv = xr[kb * W8_K + 4 * p + e];
_Pragma("omp simd")
            for (int64_t j = 0; j < TILE_COLS; ++j) acc[nb][j] += xv * b[(p * TILE_COLS + j) * 4 + e];
          }
      }
    }
    for (int nb = 0; nb < NB; ++nb) std::memcpy(c + r * TILE_GROUP * TILE_COLS + nb * TILE_COLS, acc[nb], sizeof(acc[nb]));
  }
}

// With AVX512-VNNI (no int8 tiles): vpdpbusd sums four products of unsigned by signed bytes into each
// int32 lane, and a packed block's 64 bytes [p][c][e] are the four inputs 4p .. 4p + 3 of its 16
// columns, the lanes' order. x is signed, so it enters as x + 128 (x ^ 0x80) and the pass takes 128 x
// each column's sum of W off again, which the first rows' pass adds up with the same instruction on a
// vector of ones: the same exact sums as the tiles and the plain loop (at most 255 x 128 x K in a
// lane). R rows of x against NB blocks: each 64-byte vector of W is loaded once for R rows.
#if defined(__AVX512VNNI__)
constexpr bool HAS_W8A8_VNNI = true;

template <int NB, int R, bool SUM_COLUMNS>
void w8_vnni_rows(const int8_t* xq, int64_t k_padded, const int8_t* w, int64_t column_stride, __m512i (&offset)[NB],
                  int32_t* c) {
  __m512i acc[R][NB], column_sum[NB];
  for (int nb = 0; nb < NB; ++nb) {
    column_sum[nb] = _mm512_setzero_si512();
    for (int r = 0; r < R; ++r) acc[r][nb] = _mm512_setzero_si512();
  }
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t kb = 0; kb < k_padded / W8_K; ++kb)
    for (int p = 0; p < W8_K / 4; ++p) {      // inputs 64 kb + 4 p .. + 3: 64 bytes [c][e] of each block
      const int8_t* wk = w + kb * W8_BLOCK + p * 4 * TILE_COLS;
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
      _mm512_storeu_si512(c + r * TILE_GROUP * TILE_COLS + nb * TILE_COLS, _mm512_sub_epi32(acc[r][nb], offset[nb]));
}

// The int32 sums of rows [0, m) of xq against NB blocks from block n_block, c [m][64], four rows a time.
template <int NB>
void w8_vnni_pass(const int8_t* xq, int64_t m, int64_t k_padded, const int8_t* w, int64_t n_block, int32_t* c) {
  const int64_t column_stride = k_padded / W8_K * W8_BLOCK;
  const int8_t* wb = w + n_block * column_stride;
  __m512i offset[NB];
  for (int64_t r = 0; r < m; r += 4) {
    const auto rows_pass = [&](auto rows) {
      constexpr int R = decltype(rows)::value;
      if (r == 0) w8_vnni_rows<NB, R, true>(xq, k_padded, wb, column_stride, offset, c);
      else w8_vnni_rows<NB, R, false>(xq + r * k_padded, k_padded, wb, column_stride, offset, c + r * TILE_GROUP * TILE_COLS);
    };
    with_count(std::min<int64_t>(4, m - r), rows_pass);
  }
}
#else
constexpr bool HAS_W8A8_VNNI = false;
#endif

constexpr bool HAS_W8A8_TILES = HAS_TILE_PRODUCT && HAS_INT8_TILES;
std::atomic<bool> w8a8_fast_enabled{true};
void set_w8a8_fast(bool enabled) { w8a8_fast_enabled = enabled; }      // off: the plain loop (tests, benchmarks)
bool w8a8_tiles_run() { return HAS_W8A8_TILES && w8a8_fast_enabled && tiles_granted(); }
bool w8a8_vnni_run() { return HAS_W8A8_VNNI && w8a8_fast_enabled && !w8a8_tiles_run(); }
bool w8a8_fast_run() { return w8a8_tiles_run() || w8a8_vnni_run(); }      // not the plain loop

// Where w8a8_linear's int32 sums are taken here, in the start-up log's words.
std::string w8a8_products() {
  if (w8a8_tiles_run()) return "AMX int8 tiles";
  if (w8a8_vnni_run()) return "AVX512-VNNI";
  return "a plain loop";
}

// out[j] = float(sums[j]) * row_scale * w_scale[j] (+ bias[j]), rounded to T: the reference's operations
// in its order, each rounded to float32, so the two agree bit for bit. The empty asm hands the product
// on as an opaque register: without it the compiler fuses the multiply and the bias add into an FMA,
// which skips a rounding (float32 rows with a bias were a unit in the last place off).
template <typename T>
void store_w8a8_row(T* out, const int32_t* sums, float row_scale, const float* w_scale, const T* bias, int64_t width) {
  int64_t j = 0;
#if defined(__AVX512F__)
  if constexpr (VECTOR_TYPE<T>) {
    const __m512 by = _mm512_set1_ps(row_scale);
    for (; j + 16 <= width; j += 16) {
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_loadu_si512(sums + j));
      __m512 v = _mm512_mul_ps(_mm512_mul_ps(sum, by), _mm512_loadu_ps(w_scale + j));
      asm("" : "+v"(v));
      store_ps(out + j, bias ? _mm512_add_ps(v, load_ps(bias + j)) : v);
    }
  }
#endif
  for (; j < width; ++j) {
    float v = static_cast<float>(sums[j]) * row_scale * w_scale[j];
    asm("" : "+x"(v));
    out[j] = round_to<T>(bias ? v + to_float(bias[j]) : v);
  }
}

// y [rows, N] = W8A8 product of x [rows, k_dim] on raw rows; xq [rows, k_padded] and xs [rows] take
// the quantized rows and their scales (quantized on this thread alone where `alone`).
template <typename T>
void w8a8_into(const T* x, int64_t rows, int64_t k_dim, const at::Tensor& packed, const at::Tensor& scale,
               const T* bp, int8_t* xq, float* xs, T* yp, bool alone = false) {
  const int64_t n_blocks = packed.size(0), k_padded = packed.size(1) * W8_K, n_dim = scale.numel();
  const bool tiles = w8a8_tiles_run(), vnni = w8a8_vnni_run();
  quantize_rows(x, rows, k_dim, k_padded, xq, xs, alone);
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* wsp = scale.data_ptr<float>();
  blocked_product<int32_t>(
      rows, n_blocks, tiles,
      [&](auto blocks, int64_t m0, int64_t m, int64_t first, int32_t* c) {
        constexpr int NB = decltype(blocks)::value;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
        if (tiles) return tile_pass<Int8Tiles, NB>(xq + m0 * k_padded, k_padded, wp, first, c);
#endif
#if defined(__AVX512VNNI__)
        if (vnni) return w8_vnni_pass<NB>(xq + m0 * k_padded, m, k_padded, wp, first, c);
#endif
        w8_plain_pass<NB>(xq + m0 * k_padded, m, k_padded, wp, first, c);
      },
      [&](int64_t m0, int64_t m, int64_t first, int64_t nb, const int32_t* c) {
        const int64_t n0 = first * TILE_COLS, width = std::min(nb * TILE_COLS, n_dim - n0);
        for (int64_t r = 0; r < m; ++r)
          store_w8a8_row(yp + (m0 + r) * n_dim + n0, c + r * TILE_GROUP * TILE_COLS, xs[m0 + r], wsp + n0,
                         bp ? bp + n0 : nullptr, width);
      });
}

// w8a8_linear's checks: W packed, x's width within its padded inputs, scale float32 [N], bias [N].
void check_w8a8(int64_t k_dim, at::ScalarType dtype, const at::Tensor& packed, const at::Tensor& scale,
                const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(is_w8a8_packed(packed) && packed.is_contiguous(),
              "w8a8_linear: weight must be packed contiguous int8 [N / 16, K / 64, 16, 16, 4]");
  const int64_t n_blocks = packed.size(0), k_padded = packed.size(1) * W8_K;
  const int64_t n_dim = scale.numel();
  TORCH_CHECK(k_dim <= k_padded && k_dim > k_padded - W8_K, "w8a8_linear: input width ", k_dim,
              " does not fit the weight's ", k_padded, " (padded) inputs");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && n_dim <= n_blocks * TILE_COLS &&
              n_dim > (n_blocks - 1) * TILE_COLS, "w8a8_linear: scale must be float32 [N] for the packed blocks");
  TORCH_CHECK(!bias || (bias->scalar_type() == dtype && bias->numel() == n_dim),
              "w8a8_linear: bias must be [N] of the input's dtype");
}

at::Tensor w8a8_linear(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias) {
  check_w8a8(x_in.size(-1), x_in.scalar_type(), packed, scale, bias);
  const int64_t k_dim = x_in.size(-1), k_padded = packed.size(1) * W8_K;
  const auto ops = product_operands(x_in, k_dim, scale.numel(), bias);
  const int64_t rows = ops.x.size(0);
  if (rows == 0) return ops.y.view(ops.out_shape);
  auto xq = at::empty({rows, k_padded}, packed.options());
  auto xs = at::empty({rows}, scale.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, ops.x.scalar_type(), "w8a8_linear", [&] {
    w8a8_into(ops.x.data_ptr<scalar_t>(), rows, k_dim, packed, scale, bias ? ops.bias.data_ptr<scalar_t>() : nullptr,
              xq.data_ptr<int8_t>(), xs.data_ptr<float>(), ops.y.data_ptr<scalar_t>());
  });
  return ops.y.view(ops.out_shape);
}

// The few-row product of T = float or bf16 (product_block's overloads): blocks of FLOAT_BLOCK rows of
// W split evenly across the threads, each against the rows of x two at a time.
template <typename T>
at::Tensor few_row_product(const at::Tensor& x_in, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const int64_t k_dim = weight.size(1), n_dim = weight.size(0);
  const auto ops = product_operands(x_in, k_dim, n_dim, bias);
  const int64_t rows = ops.x.size(0);
  const T* xp = ops.x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  const T* bp = bias ? ops.bias.data_ptr<T>() : nullptr;
  T* yp = ops.y.data_ptr<T>();
  const int64_t blocks = (n_dim + FLOAT_BLOCK - 1) / FLOAT_BLOCK;
  const bool prefetch = float_prefetch_enabled;
  at::parallel_for(0, blocks, 2, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * FLOAT_BLOCK, nb = std::min(FLOAT_BLOCK, n_dim - n0);
      const T* wb = wp + n0 * k_dim;
      const T* bb = bp ? bp + n0 : nullptr;
      const T* next = prefetch && blk + 1 < end && n0 + 2 * FLOAT_BLOCK <= n_dim ? wb + FLOAT_BLOCK * k_dim : nullptr;
      int64_t m = 0;      // the first pass over the block reads it from memory: it fetches the next
      for (; m + 2 <= rows; m += 2)
        product_block<2>(xp + m * k_dim, k_dim, wb, nb, bb, yp + m * n_dim + n0, n_dim, m == 0 ? next : nullptr);
      for (; m < rows; ++m)
        product_block<1>(xp + m * k_dim, k_dim, wb, nb, bb, yp + m * n_dim + n0, n_dim, m == 0 ? next : nullptr);
    }
  });
  return ops.y.view(ops.out_shape);
}

// torch's product, or the few-row ones above where they apply.
at::Tensor float_linear(const at::Tensor& x_in, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  if (is_tile_packed(weight)) {
    const int64_t n_dim = weight.size(0) * 16;
    TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && x_in.size(-1) == weight.size(1) * 32,
                "linear: a tile-packed weight takes bf16 rows of ", weight.size(1) * 32, " values");
    TORCH_CHECK(!bias || (bias->scalar_type() == at::kBFloat16 && bias->numel() == n_dim),
                "linear: the bias of a tile-packed weight is ", n_dim, " bf16 values");
    if (!float_products_enabled) return at::linear(x_in, tile_unpack(weight), bias);     // benchmarks only
    return packed_product<c10::BFloat16>(x_in, weight, bias);
  }
  if (is_f32_packed(weight)) {
    const int64_t n_dim = weight.size(0) * 16;
    TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.size(-1) == weight.size(1),
                "linear: a packed float32 weight takes float32 rows of ", weight.size(1), " values");
    TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->numel() == n_dim),
                "linear: the bias of a packed float32 weight is ", n_dim, " float32 values");
    if (!float_products_enabled) return at::linear(x_in, tile_unpack(weight), bias);     // benchmarks only
    return packed_product<float>(x_in, weight, bias);
  }
#if defined(__AVX512BF16__)
  if (native_bf16_linear(x_in, weight, bias)) return few_row_product<c10::BFloat16>(x_in, weight, bias);
#endif
  if (native_float_linear(x_in, weight, bias)) return few_row_product<float>(x_in, weight, bias);
  return at::linear(x_in, weight, bias);
}

// A linear layer as the model holds it: a float weight [N, K] (float_linear), a W8A8 weight with its
// scales (w8a8_linear, every row count), or a weight-only int8 one (int8_linear for a few rows, else
// the dequantized weight through torch).
at::Tensor layer_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                        const c10::optional<at::Tensor>& scale, int64_t int8_max_rows) {
  if (!scale) return float_linear(x, weight, bias);
  if (is_w8a8_packed(weight)) return w8a8_linear(x, weight, *scale, bias);
  if (x.numel() / x.size(-1) <= int8_max_rows) return int8_linear(x, weight, *scale, bias);
  return at::linear(x, int8_dequantize(weight, *scale, x.scalar_type()), bias);
}

// ---- a dense layer stack in one parallel region (Team) ----

// One product of a layer in a team: a weight in a packed form that runs at every row count (bf16 or
// float32 for packed_product, int8 with its scales for w8a8_linear), its bias contiguous, and its shape.
struct TeamProduct {
  at::Tensor weight, scale, bias;
  int64_t k_dim = 0, n_dim = 0, k_padded = 0;
};

// The product of (weight, bias, scale) as a team runs it for activations of `dtype`, or nullopt where
// it runs otherwise (int8 weight-only, weights as loaded, torch's product): then the stack runs as
// before, a region per loop.
c10::optional<TeamProduct> team_product(const c10::optional<at::Tensor>& w, const c10::optional<at::Tensor>& b,
                                        const c10::optional<at::Tensor>& s, at::ScalarType dtype) {
  TeamProduct p;
  p.weight = *w;
  if (s) {
    if (!is_w8a8_packed(p.weight) || !p.weight.is_contiguous() || dtype == at::kHalf) return c10::nullopt;
    p.scale = *s;
    p.n_dim = s->numel();
    p.k_padded = p.weight.size(1) * W8_K;
    p.k_dim = -1;                                   // any width within the padded inputs (check_w8a8)
  } else if (float_products_enabled && ((is_tile_packed(p.weight) && dtype == at::kBFloat16 && HAS_BF16_PRODUCT) ||
                                         (is_f32_packed(p.weight) && dtype == at::kFloat && HAS_F32_PACKED))) {
    p.k_dim = packed_inputs(p.weight);
    p.n_dim = p.weight.size(0) * TILE_COLS;
  } else {
    return c10::nullopt;
  }
  if (b) p.bias = b->contiguous();
  return p;
}

// Checks that x [rows, k_dim] of `dtype` fits p (before the region: nothing in it may throw but a loop).
void check_team_product(const TeamProduct& p, int64_t k_dim, at::ScalarType dtype, const char* name) {
  if (p.scale.defined()) {
    check_w8a8(k_dim, dtype, p.weight, p.scale,
               p.bias.defined() ? c10::optional<at::Tensor>(p.bias) : c10::optional<at::Tensor>());
  } else {
    TORCH_CHECK(p.k_dim == k_dim, "dense_layers: the ", name, " product takes ", p.k_dim, " inputs, not ", k_dim);
    TORCH_CHECK(!p.bias.defined() || (p.bias.scalar_type() == dtype && p.bias.numel() == p.n_dim),
                "dense_layers: the ", name, " bias must be ", p.n_dim, " values of the activations' dtype");
  }
}

// y [rows, n_dim] = x [rows, k_dim] . p, in the team; xq and xs take W8A8's quantized rows: shared, or
// the thread's own where `own_rows` (each thread quantizes every row itself, no barrier before the sums).
template <typename T>
void team_linear(const T* x, int64_t rows, int64_t k_dim, const TeamProduct& p, int8_t* xq, float* xs, T* y,
                 bool own_rows) {
  const T* bias = p.bias.defined() ? p.bias.data_ptr<T>() : nullptr;
  if (p.scale.defined()) return w8a8_into(x, rows, k_dim, p.weight, p.scale, bias, xq, xs, y, own_rows);
  packed_into(x, rows, p.weight, bias, y);
}

// out = x + delta, rounded to T (the residual add after the last layer, or before a layer without an
// input norm), in the team.
template <typename T>
void add_into(const T* x, const T* delta, T* out, int64_t rows, int64_t width, bool alone) {
  row_loop(rows, 16, alone, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * width; i < end * width; ++i) out[i] = round_to<T>(to_float(x[i]) + to_float(delta[i]));
  });
}

// At most this many rows, each thread of a team runs the row-wise steps (norms, the residual adds,
// SwiGLU, W8A8's quantization) over every row into its own buffers, the same values, instead of
// sharing them out and waiting at a barrier: at a few rows a barrier costs more than the rows.
constexpr int64_t OWN_ROWS = 16;
std::atomic<bool> own_rows_enabled{true};       // off: the row-wise steps spread at every row count (benchmarks)
void set_own_rows(bool enabled) { own_rows_enabled = enabled; }

struct TeamLayer {
  at::Tensor input_norm, post_norm, k_cache, v_cache;
  c10::optional<at::Tensor> q_norm, k_norm;
  TeamProduct qkv, o, gate_up, down;
};

// The layers of dense_layers as a team runs them over rows of `hidden` values of `dtype` (every product in
// a packed form, the activations bf16 or float32, the shapes checked), or an empty list where the stack
// runs region by region.
std::vector<TeamLayer> team_layers(at::ScalarType dtype, int64_t hidden, const std::vector<at::Tensor>& k_caches,
                                   const std::vector<at::Tensor>& v_caches,
                                   const std::vector<std::vector<c10::optional<at::Tensor>>>& layers,
                                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  if ((dtype != at::kBFloat16 && dtype != at::kFloat) || at::get_num_threads() < 2) return {};
  std::vector<TeamLayer> team;
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto& w = layers[i];
    const auto qkv = team_product(w[2], w[3], w[4], dtype), o = team_product(w[5], w[6], w[7], dtype);
    const auto gate_up = team_product(w[8], w[9], w[10], dtype), down = team_product(w[11], w[12], w[13], dtype);
    if (!qkv || !o || !gate_up || !down) return {};
    TeamLayer layer{w[0] ? w[0]->contiguous() : at::Tensor(), w[1]->contiguous(), k_caches[i], v_caches[i],
                    w[14] ? c10::optional<at::Tensor>(w[14]->contiguous()) : c10::nullopt,
                    w[15] ? c10::optional<at::Tensor>(w[15]->contiguous()) : c10::nullopt, *qkv, *o, *gate_up, *down};
    team.push_back(std::move(layer));
  }
  const int64_t inter = team[0].gate_up.n_dim / 2;
  for (const auto& layer : team) {
    for (const auto* norm : {&layer.input_norm, &layer.post_norm})
      TORCH_CHECK(!norm->defined() || (norm->numel() == hidden && norm->scalar_type() == dtype),
                  "dense_layers: a norm's weight must be [", hidden, "] of the activations' dtype");
    check_team_product(layer.qkv, hidden, dtype, "qkv");
    TORCH_CHECK(layer.qkv.n_dim == (num_heads + 2 * num_kv_heads) * head_dim, "dense_layers: the qkv product gives ",
                layer.qkv.n_dim, " values, not (", num_heads, " + 2 * ", num_kv_heads, ") * ", head_dim);
    check_team_product(layer.o, num_heads * head_dim, dtype, "o");
    TORCH_CHECK(layer.o.n_dim == hidden && layer.down.n_dim == hidden, "dense_layers: o and down must give ", hidden, " values");
    TORCH_CHECK(layer.gate_up.n_dim == 2 * inter, "dense_layers: every layer's gate|up must give ", 2 * inter, " values");
    check_team_product(layer.gate_up, hidden, dtype, "gate_up");
    check_team_product(layer.down, inter, dtype, "down");
  }
  return team;
}

// The buffers a team's layers share over `tokens` rows (allocated before the region).
struct TeamShared {
  int64_t tokens, hidden, inter, k_padded;
  bool own_rows;                     // a few rows: the row-wise steps each thread's own (OWN_ROWS)
  at::Tensor stream[2], normed, post, h, delta, qkv, attended, gate_up, act, queries, xq, xs;

  TeamShared(int64_t tokens_, int64_t hidden_, const std::vector<TeamLayer>& layers, const Heads& heads,
             const at::TensorOptions& opts, int64_t other_k_padded = 1)   // other products' W8A8 rows
      : tokens(tokens_), hidden(hidden_), inter(layers[0].gate_up.n_dim / 2), k_padded(other_k_padded),
        own_rows(own_rows_enabled && tokens_ <= OWN_ROWS) {
    for (const auto& layer : layers)
      for (const auto* p : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down}) k_padded = std::max(k_padded, p->k_padded);
    for (auto* t : {&stream[0], &stream[1], &normed, &post, &h, &delta}) *t = at::empty({tokens, hidden}, opts);
    qkv = at::empty({tokens, layers[0].qkv.n_dim}, opts);
    attended = at::empty({tokens, heads.q * heads.dim}, opts);
    gate_up = at::empty({tokens, 2 * inter}, opts);
    act = at::empty({tokens, inter}, opts);
    queries = at::empty({tokens * heads.q * heads.dim}, opts.dtype(at::kFloat));
    xq = at::empty({tokens, k_padded}, opts.dtype(at::kChar));
    xs = at::empty({tokens}, opts.dtype(at::kFloat));
  }
};

// One thread's view of a team's buffers: where own_rows, its own copies of the rows the row-wise steps
// write (the stream, its norms, h, SwiGLU's output, W8A8's quantized rows); else the shared ones.
template <typename T>
struct TeamRows {
  std::vector<T> own;
  std::vector<int8_t> own_q;
  std::vector<float> own_s;
  T *normed, *h, *post, *act, *own_x;
  int8_t* q8;
  float* qs;

  explicit TeamRows(const TeamShared& sh)
      : own(sh.own_rows ? sh.tokens * (4 * sh.hidden + sh.inter) : 0),
        own_q(sh.own_rows ? sh.tokens * sh.k_padded : 0), own_s(sh.own_rows ? sh.tokens : 0) {
    normed = sh.own_rows ? own.data() : sh.normed.data_ptr<T>();
    h = sh.own_rows ? normed + sh.tokens * sh.hidden : sh.h.data_ptr<T>();
    post = sh.own_rows ? h + sh.tokens * sh.hidden : sh.post.data_ptr<T>();
    act = sh.own_rows ? post + sh.tokens * sh.hidden : sh.act.data_ptr<T>();
    own_x = sh.own_rows ? act + sh.tokens * sh.inter : nullptr;
    q8 = sh.own_rows ? own_q.data() : sh.xq.data_ptr<int8_t>();
    qs = sh.own_rows ? own_s.data() : sh.xs.data_ptr<float>();
  }
};

// Where a batch's sequences sit (attention's layout) and the model's attention scalars.
struct TeamBatch {
  const at::Tensor &rope, &q_start, &q_len, &kv_len, &rows, &table;
  float eps;
  double qk_eps, scale;
  Heads heads;
};

// The layers over x [tokens, hidden] (every thread reads it) inside a team region, run by every thread;
// returns the stream after the last layer (the thread's own where own_rows, else a shared buffer).
template <typename T>
const T* team_layers_run(const T* x, const std::vector<TeamLayer>& layers, const TeamShared& sh, TeamRows<T>& mine,
                         const TeamBatch& batch) {
  const int64_t tokens = sh.tokens, hidden = sh.hidden, inter = sh.inter;
  const bool own_rows = sh.own_rows;
  T* dp = sh.delta.data_ptr<T>();
  T* gp = sh.gate_up.data_ptr<T>();
  const float eps = batch.eps;
  if (layers[0].input_norm.defined())
    rms_norm_into(x, layers[0].input_norm.data_ptr<T>(), mine.normed, tokens, hidden, eps, own_rows);
  for (size_t i = 0; i < layers.size(); ++i) {
    const TeamLayer& layer = layers[i];
    at::Tensor k_cache = layer.k_cache, v_cache = layer.v_cache, out = sh.attended;
    team_linear(layer.input_norm.defined() ? mine.normed : x, tokens, hidden, layer.qkv, mine.q8, mine.qs,
                sh.qkv.data_ptr<T>(), own_rows);
    attention_impl<T>(sh.qkv, batch.heads, k_cache, v_cache, batch.q_start, batch.q_len, batch.kv_len, batch.rows,
                      batch.table, batch.rope, layer.q_norm, layer.k_norm, batch.qk_eps, batch.scale, out,
                      sh.queries.data_ptr<float>());
    team_linear(sh.attended.data_ptr<T>(), tokens, batch.heads.q * batch.heads.dim, layer.o, mine.q8, mine.qs, dp, own_rows);
    add_rms_norm_into(x, dp, layer.post_norm.data_ptr<T>(), mine.h, mine.post, tokens, hidden, eps, own_rows);
    team_linear(mine.post, tokens, hidden, layer.gate_up, mine.q8, mine.qs, gp, own_rows);
    silu_mul_into(gp, 2 * inter, mine.act, tokens, inter, own_rows);
    team_linear(mine.act, tokens, inter, layer.down, mine.q8, mine.qs, dp, own_rows);
    // the residual stream: h + down, and the next layer's norm of it
    T* next = own_rows ? mine.own_x : sh.stream[i % 2].data_ptr<T>();
    if (i + 1 < layers.size() && layers[i + 1].input_norm.defined())
      add_rms_norm_into(mine.h, dp, layers[i + 1].input_norm.data_ptr<T>(), next, mine.normed, tokens, hidden, eps,
                        own_rows);
    else
      add_into(mine.h, dp, next, tokens, hidden, own_rows);
    x = next;
  }
  return x;
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

// dense_layers with every thread in one region for the whole stack (Team): the same kernels on the
// same rows, so the same values as layer after layer, region after region.
template <typename T>
at::Tensor team_dense_layers(const at::Tensor& x_in, const std::vector<TeamLayer>& layers, const TeamBatch& batch) {
  const at::Tensor x0 = x_in.reshape({-1, x_in.size(-1)}).contiguous();
  const TeamShared sh(x0.size(0), x0.size(1), layers, batch.heads, x0.options());
  for (const auto& layer : layers)
    check_attention(sh.qkv, batch.heads.q, batch.heads.kv, batch.heads.dim, layer.k_cache, layer.v_cache,
                    batch.q_start, batch.q_len, batch.kv_len, batch.rows, batch.table, batch.rope);
  team_stacks += 1;
  at::Tensor out = sh.stream[(layers.size() - 1) % 2];
  in_team([&](const Team& team) {
    TeamRows<T> mine(sh);
    const T* x = team_layers_run(x0.data_ptr<T>(), layers, sh, mine, batch);
    if (sh.own_rows && team.rank == 0 && !team.failed->load())
      std::memcpy(out.data_ptr<T>(), x, sh.tokens * sh.hidden * sizeof(T));
  });
  return out.view(x_in.sizes());
}

// The stack in one region where a team runs it (teams on, team_layers' conditions), else nullopt.
c10::optional<at::Tensor> stack_in_team(const at::Tensor& x_in, const at::Tensor& rope, const std::vector<at::Tensor>& k_caches,
                                        const std::vector<at::Tensor>& v_caches, const at::Tensor& q_start,
                                        const at::Tensor& q_len, const at::Tensor& kv_len, const at::Tensor& rows,
                                        const at::Tensor& table, const std::vector<std::vector<c10::optional<at::Tensor>>>& layers,
                                        double eps, double qk_eps, int64_t num_heads, int64_t num_kv_heads,
                                        int64_t head_dim, double scale) {
  if (!teams_enabled || layers.empty()) return c10::nullopt;
  if (x_in.numel() == 0) return c10::nullopt;
  const auto team = team_layers(x_in.scalar_type(), x_in.size(-1), k_caches, v_caches, layers, num_heads,
                                num_kv_heads, head_dim);
  if (team.empty()) return c10::nullopt;
  const TeamBatch batch{rope, q_start, q_len, kv_len, rows, table, static_cast<float>(eps), qk_eps, scale,
                        Heads{num_heads, num_kv_heads, head_dim}};
  if (x_in.scalar_type() == at::kBFloat16) return team_dense_layers<c10::BFloat16>(x_in, team, batch);
  return team_dense_layers<float>(x_in, team, batch);
}

// One pre-norm decoder layer of the dense models (engine/models/llama.py: DecoderLayer with a GatedMLP)
// in one call: h = x + o(attention(qkv(norm(x)))); out = h + down(silu(gate) * up)(norm(h)). The same
// functions the layer's modules call one by one from Python, without a Python call between them; in
// one parallel region where a team runs it (stack_in_team).
at::Tensor dense_layer(const at::Tensor& x, const at::Tensor& rope, at::Tensor k_cache, at::Tensor v_cache,
                       const at::Tensor& q_start, const at::Tensor& q_len, const at::Tensor& kv_len,
                       const at::Tensor& rows, const at::Tensor& table,
                       const c10::optional<at::Tensor>& input_norm, const at::Tensor& post_norm, double eps,
                       const at::Tensor& qkv_w, const c10::optional<at::Tensor>& qkv_b, const c10::optional<at::Tensor>& qkv_s,
                       const at::Tensor& o_w, const c10::optional<at::Tensor>& o_b, const c10::optional<at::Tensor>& o_s,
                       const at::Tensor& gu_w, const c10::optional<at::Tensor>& gu_b, const c10::optional<at::Tensor>& gu_s,
                       const at::Tensor& down_w, const c10::optional<at::Tensor>& down_b,
                       const c10::optional<at::Tensor>& down_s, const c10::optional<at::Tensor>& q_norm,
                       const c10::optional<at::Tensor>& k_norm, double qk_eps, int64_t num_heads, int64_t num_kv_heads,
                       int64_t head_dim, double scale, int64_t int8_max_rows) {
  const std::vector<c10::optional<at::Tensor>> listed{input_norm, post_norm, qkv_w, qkv_b, qkv_s, o_w, o_b, o_s,
                                                      gu_w, gu_b, gu_s, down_w, down_b, down_s, q_norm, k_norm};
  if (auto out = stack_in_team(x, rope, {k_cache}, {v_cache}, q_start, q_len, kv_len, rows, table, {listed}, eps,
                               qk_eps, num_heads, num_kv_heads, head_dim, scale))
    return *out;
  const at::Tensor normed = input_norm ? rms_norm(x, *input_norm, eps) : x;
  const at::Tensor qkv = layer_linear(normed, qkv_w, qkv_b, qkv_s, int8_max_rows);
  const at::Tensor attended = attention(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, q_start, q_len,
                                        kv_len, rows, table, rope, q_norm, k_norm, qk_eps, scale);
  const auto [h, post] = add_rms_norm(x, layer_linear(attended, o_w, o_b, o_s, int8_max_rows), post_norm, eps);
  const at::Tensor act = silu_mul(layer_linear(post, gu_w, gu_b, gu_s, int8_max_rows));
  return h + layer_linear(act, down_w, down_b, down_s, int8_max_rows);
}

// A layer's tensors as one list, in dense_layer's order (input_norm, post_norm, qkv w/b/s, o w/b/s,
// gate_up w/b/s, down w/b/s, q_norm, k_norm; absent ones None): checked once, then run as dense_layer.
void check_layer_list(const std::vector<c10::optional<at::Tensor>>& w, const char* caller) {
  TORCH_CHECK(w.size() == 16 && w[1] && w[2] && w[5] && w[8] && w[11], caller, ": a layer is malformed");
}

at::Tensor listed_dense_layer(const at::Tensor& x, const at::Tensor& rope, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const at::Tensor& q_start, const at::Tensor& q_len,
                              const at::Tensor& kv_len, const at::Tensor& rows, const at::Tensor& table,
                              const std::vector<c10::optional<at::Tensor>>& w, double eps, double qk_eps,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
                              int64_t int8_max_rows) {
  return dense_layer(x, rope, k_cache, v_cache, q_start, q_len, kv_len, rows, table, w[0], *w[1], eps, *w[2], w[3],
                     w[4], *w[5], w[6], w[7], *w[8], w[9], w[10], *w[11], w[12], w[13], w[14], w[15], qk_eps,
                     num_heads, num_kv_heads, head_dim, scale, int8_max_rows);
}

// Every layer of a dense model in one call (dense_layer after dense_layer, the residual stream in
// between): the stream runs the whole stack without coming back to Python. `layers[i]` holds layer
// i's tensors in dense_layer's order (input_norm, post_norm, qkv w/b/s, o w/b/s, gate_up w/b/s,
// down w/b/s, q_norm, k_norm; absent ones None); the scalars are every layer's.
at::Tensor dense_layers(const at::Tensor& x_in, const at::Tensor& rope, std::vector<at::Tensor> k_caches,
                        std::vector<at::Tensor> v_caches, const at::Tensor& q_start, const at::Tensor& q_len,
                        const at::Tensor& kv_len, const at::Tensor& rows, const at::Tensor& table,
                        const std::vector<std::vector<c10::optional<at::Tensor>>>& layers, double eps,
                        double qk_eps, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
                        int64_t int8_max_rows) {
  TORCH_CHECK(k_caches.size() == layers.size() && v_caches.size() == layers.size(),
              "dense_layers: one K and one V cache per layer");
  for (size_t i = 0; i < layers.size(); ++i) check_layer_list(layers[i], "dense_layers");
  if (auto out = stack_in_team(x_in, rope, k_caches, v_caches, q_start, q_len, kv_len, rows, table, layers, eps,
                               qk_eps, num_heads, num_kv_heads, head_dim, scale))
    return *out;
  at::Tensor x = x_in;
  for (size_t i = 0; i < layers.size(); ++i)
    x = listed_dense_layer(x, rope, k_caches[i], v_caches[i], q_start, q_len, kv_len, rows, table, layers[i], eps,
                           qk_eps, num_heads, num_kv_heads, head_dim, scale, int8_max_rows);
  return x;
}

// The experts of a sparse MoE block (engine/models/moe.py: StackedExperts) in one call: for each held
// expert e (ids first .. first + E - 1) with routed pairs, its tokens' rows run gate_up[e], SwiGLU and
// down[e] (float_linear's products), and out[t] = sum over t's pairs, in expert order, of weight * output,
// each product and sum rounded to the dtype: what the grouped pure-torch path computes with one
// Python iteration and some ten operators per expert.
at::Tensor moe_experts(const at::Tensor& x_in, const at::Tensor& expert_ids_in, const at::Tensor& weights_in,
                       const at::Tensor& gate_up, const at::Tensor& down, int64_t first) {
  const auto x = x_in.contiguous();
  check_cpu_rows(x, "x");
  const auto expert_ids = expert_ids_in.to(at::kLong).contiguous();
  const auto weights = weights_in.to(at::kFloat).contiguous();
  const int64_t tokens = x.size(0), top_k = expert_ids.size(1), experts = gate_up.size(0);
  TORCH_CHECK(expert_ids.dim() == 2 && expert_ids.size(0) == tokens && weights.sizes() == expert_ids.sizes(),
              "moe_experts: expert_ids and weights must be [tokens, top_k]");
  // a stack of [N, K] matrices, or of packed ones (tile_pack: bf16 [E, N/16, K/32, 16, 16, 2], float32
  // [E, N/16, K, 16])
  auto stacked = [](const at::Tensor& t) {
    return t.dim() == 3 || (t.dim() == 6 && is_tile_packed(t[0])) || (t.dim() == 4 && is_f32_packed(t[0]));
  };
  auto outputs = [](const at::Tensor& t) { return t.dim() > 3 ? t.size(1) * 16 : t.size(1); };
  auto inputs = [](const at::Tensor& t) { return t.dim() == 6 ? t.size(2) * 32 : t.size(2); };
  TORCH_CHECK(stacked(gate_up) && stacked(down) && down.size(0) == experts && inputs(gate_up) == x.size(1)
              && outputs(down) == x.size(1) && outputs(gate_up) == 2 * inputs(down), "moe_experts: expert weights do not fit");
  // pairs grouped by held expert, in pair order within each (a counting sort)
  const int64_t* ids = expert_ids.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> pairs(experts);
  for (int64_t i = 0; i < tokens * top_k; ++i) {
    const int64_t e = ids[i] - first;
    if (e >= 0 && e < experts) pairs[e].push_back(i);
  }
  auto out = at::zeros_like(x);
  const float* w = weights.data_ptr<float>();
  const int64_t width = x.size(1);
  for (int64_t e = 0; e < experts; ++e) {
    const auto& routed = pairs[e];
    if (routed.empty()) continue;
    std::vector<int64_t> rows(routed.size());
    for (size_t j = 0; j < routed.size(); ++j) rows[j] = routed[j] / top_k;
    const at::Tensor inputs = rows.size() == 1 ? x.narrow(0, rows[0], 1)
                                               : x.index_select(0, at::tensor(rows, x.options().dtype(at::kLong)));
    const at::Tensor y = float_linear(silu_mul(float_linear(inputs, gate_up[e], {})), down[e], {}).contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "moe_experts", [&] {
      const auto* yp = y.data_ptr<scalar_t>();
      auto* op = out.data_ptr<scalar_t>();
      for (size_t j = 0; j < routed.size(); ++j) {
        const scalar_t weight = static_cast<scalar_t>(w[routed[j]]);
        scalar_t* o = op + rows[j] * width;
        const scalar_t* yr = yp + j * width;
        for (int64_t c = 0; c < width; ++c) {
          const scalar_t term = static_cast<scalar_t>(to_float(yr[c]) * to_float(weight));
          o[c] = static_cast<scalar_t>(to_float(o[c]) + to_float(term));
        }
      }
    });
  }
  return out;
}

// A draft step's choice: each row's argmax (the first of equal maxima, or the first NaN, as torch's
// max) and its softmax probability 1 / sum_j e^(l_j - max), in one pass over the logits where the
// torch path (spec/chains.py: top_choice) runs five operators.
void top_of_row(const float* row, int64_t vocab, int64_t* top, float* confidence) {
  float best = row[0];
  int64_t at = 0;
  for (int64_t j = 0; j < vocab && !std::isnan(best); ++j)
    if (row[j] > best || std::isnan(row[j])) best = row[j], at = j;
  float total = 0.f;
_Pragma("omp simd reduction(+ : total)")
  for (int64_t j = 0; j < vocab; ++j) total += fast_exp(row[j] - best);
  *top = at;
  *confidence = 1.f / total;
}

std::tuple<at::Tensor, at::Tensor> top_choice(const at::Tensor& logits_in) {
  TORCH_CHECK(logits_in.dim() == 2 && logits_in.size(1) > 0, "top_choice: logits must be [rows, vocab > 0]");
  const auto logits = logits_in.to(at::kFloat).contiguous();
  check_cpu_rows(logits, "logits");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  auto top = at::empty({rows}, logits.options().dtype(at::kLong));
  auto confidence = at::empty({rows}, logits.options());
  const float* lp = logits.data_ptr<float>();
  int64_t* tp = top.data_ptr<int64_t>();
  float* cp = confidence.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) top_of_row(lp + r * vocab, vocab, tp + r, cp + r);
  return {top, confidence};
}

std::atomic<int64_t> team_chains{0};      // chains run in a team since the module loaded (tests)
int64_t team_chains_run() { return team_chains.load(); }

// eagle_chain (below) with every thread in one region for the whole chain (a Team): where the head's
// fc, its layer and its LM head run in a team (team_product, team_layers) and the batch is a few rows
// (OWN_ROWS). Each thread gathers the embeddings and runs the keep rule itself, on the same values; the
// products, the layer's attention and the choice are shared out. The same kernels on the same rows, step
// after step, without a region opened or a tensor made between them. nullopt: the chain runs as below.
template <typename T>
std::tuple<at::Tensor, at::Tensor> team_eagle_chain(
    const at::Tensor& first, const at::Tensor& hidden, const at::Tensor& start, const at::Tensor& table, int64_t steps,
    const at::Tensor& keep_in, double threshold, const at::Tensor& embed, const at::Tensor& inv_freq,
    const TeamProduct& fc, const TeamProduct& head, const std::vector<TeamLayer>& layer, double eps, double qk_eps,
    const Heads& heads, double scale) {
  const int64_t batch = first.numel(), width = fc.n_dim, e_width = embed.size(1), vocab = head.n_dim;
  const int64_t* first_ids = first.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(first_ids[b] >= 0 && first_ids[b] < embed.size(0), "eagle_chain: draft ", first_ids[b],
                " outside the vocabulary (", embed.size(0), ")");
  const auto dtype = embed.scalar_type();
  check_team_product(fc, e_width + width, dtype, "fc");
  check_team_product(head, width, dtype, "LM head");
  TORCH_CHECK(hidden.size(1) == width && vocab <= embed.size(0), "eagle_chain: hidden [B, ", width, "] and an LM head "
              "over at most the vocabulary");
  const at::Tensor g0 = hidden.to(dtype).contiguous();
  const at::Tensor rows = at::arange(batch, first.options()), ones = at::ones_like(first);
  std::vector<at::Tensor> kv_lens, ropes;                // each step's positions, made before the region
  for (int64_t i = 1; i <= steps; ++i) {
    kv_lens.push_back(start + i);                          // the new token at position start + i - 1
    ropes.push_back(rope_table(rows, ones, kv_lens.back(), batch, inv_freq));
  }
  const TeamShared sh(batch, width, layer, heads, embed.options(), std::max(fc.k_padded, head.k_padded));
  for (int64_t i = 0; i < steps; ++i)
    check_attention(sh.qkv, heads.q, heads.kv, heads.dim, layer[0].k_cache, layer[0].v_cache, rows, ones, kv_lens[i],
                    rows, table, ropes[i]);
  at::Tensor fc_out = at::empty({batch, width}, embed.options()), logits = at::empty({batch, vocab}, embed.options());
  std::vector<int64_t> top(batch);
  std::vector<float> confidence(batch);
  std::vector<std::vector<int64_t>> drafts;              // rank 0's: each step's drafts, then what each row kept
  std::vector<std::vector<bool>> kept;
  team_chains += 1;
  in_team([&](const Team& team) {
    TeamRows<T> mine(sh);
    std::vector<T> x(batch * (e_width + width));
    std::vector<float> row(vocab);
    std::vector<int64_t> draft(first_ids, first_ids + batch);
    std::vector<bool> keep(batch);
    for (int64_t b = 0; b < batch; ++b) keep[b] = keep_in.data_ptr<bool>()[b];
    const T* g = g0.data_ptr<T>();
    const T* emb = embed.data_ptr<T>();
    for (int64_t i = 1; i <= steps; ++i) {
      for (int64_t b = 0; b < batch; ++b) {               // cat(embed[d], g)
        std::memcpy(x.data() + b * (e_width + width), emb + draft[b] * e_width, e_width * sizeof(T));
        std::memcpy(x.data() + b * (e_width + width) + e_width, g + b * width, width * sizeof(T));
      }
      team_linear(x.data(), batch, e_width + width, fc, mine.q8, mine.qs, fc_out.data_ptr<T>(), true);
      const TeamBatch step{ropes[i - 1], rows, ones, kv_lens[i - 1], rows, table, static_cast<float>(eps), qk_eps,
                           scale, heads};
      g = team_layers_run(fc_out.data_ptr<T>(), layer, sh, mine, step);
      team_linear(g, batch, width, head, mine.q8, mine.qs, logits.data_ptr<T>(), true);
      spread(0, batch, 1, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
          const T* l = logits.data_ptr<T>() + b * vocab;
          for (int64_t j = 0; j < vocab; ++j) row[j] = to_float(l[j]);
          top_of_row(row.data(), vocab, &top[b], &confidence[b]);
        }
      });
      bool any = false;                                    // the keep rule: NaN keeps
      for (int64_t b = 0; b < batch; ++b) {
        keep[b] = keep[b] && !(confidence[b] < threshold);
        any = any || keep[b];
      }
      if (!any) break;                                     // every thread: the same values, the same end
      draft = top;
      if (team.rank == 0) {
        drafts.push_back(top);
        kept.push_back(keep);
      }
    }
  });
  const int64_t m = static_cast<int64_t>(drafts.size());
  auto out = at::empty({batch, 1 + m}, first.options());
  auto kept_out = at::empty({m, batch}, keep_in.options());
  int64_t* op = out.data_ptr<int64_t>();
  bool* kp = kept_out.data_ptr<bool>();
  for (int64_t b = 0; b < batch; ++b) {
    op[b * (1 + m)] = first_ids[b];
    for (int64_t i = 0; i < m; ++i) {
      op[b * (1 + m) + 1 + i] = drafts[i][b];
      kp[i * batch + b] = kept[i][b];
    }
  }
  return {out, kept_out};
}

// An EAGLE-1 head's greedy draft chain in one call (engine/models/eagle.py: LlamaForCausalLMEagle.draft_chain),
// step after step what the head's modules compute from Python: for steps i = 1..steps, with d the last
// draft and g the head's last output, at position start + i - 1 of each row,
//   g = dense_layer(linear(cat(embed[d], g), fc)); d = argmax(lm_head(g)) with its softmax probability p;
// a row keeps verifying while it kept the draft before and p >= threshold (NaN keeps), and the chain
// ends before a step that no row keeps. Returns the drafts [B, 1 + m] (first is d_1) and what each
// row kept [m, B], for the m steps taken.
std::tuple<at::Tensor, at::Tensor> eagle_chain(
    const at::Tensor& first, const at::Tensor& hidden, const at::Tensor& start, const at::Tensor& table,
    at::Tensor k_cache, at::Tensor v_cache, int64_t steps, const at::Tensor& keep_in, double threshold,
    const at::Tensor& embed, const at::Tensor& inv_freq, const at::Tensor& fc_w, const c10::optional<at::Tensor>& fc_b,
    const c10::optional<at::Tensor>& fc_s, const at::Tensor& head_w, const c10::optional<at::Tensor>& head_s,
    const std::vector<c10::optional<at::Tensor>>& w, double eps, double qk_eps, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, double scale, int64_t int8_max_rows) {
  const int64_t batch = first.numel();
  TORCH_CHECK(first.dim() == 1 && first.scalar_type() == at::kLong && hidden.dim() == 2 && hidden.size(0) == batch
              && start.sizes() == first.sizes() && start.scalar_type() == at::kLong && table.dim() == 2
              && table.size(0) == batch && keep_in.sizes() == first.sizes() && keep_in.scalar_type() == at::kBool,
              "eagle_chain: first, start, keep [B], hidden [B, H] and table [B, W] must agree");
  check_layer_list(w, "eagle_chain");
  TORCH_CHECK(steps >= 0, "eagle_chain: steps must be >= 0");
  const auto dtype = embed.scalar_type();
  if (teams_enabled && own_rows_enabled && steps > 0 && batch > 0 && batch <= OWN_ROWS &&
      (dtype == at::kBFloat16 || dtype == at::kFloat) && first.is_contiguous() && keep_in.is_contiguous() &&
      embed.is_contiguous() && embed.dim() == 2) {
    const auto fc = team_product(fc_w, fc_b, fc_s, dtype), head = team_product(head_w, {}, head_s, dtype);
    const auto layer = fc && head ? team_layers(dtype, hidden.size(1), {k_cache}, {v_cache}, {w}, num_heads, num_kv_heads,
                                                head_dim)
                                  : std::vector<TeamLayer>{};
    if (!layer.empty() && fc->n_dim == hidden.size(1)) {
      const Heads heads{num_heads, num_kv_heads, head_dim};
      if (dtype == at::kBFloat16)
        return team_eagle_chain<c10::BFloat16>(first, hidden, start, table, steps, keep_in, threshold, embed, inv_freq,
                                               *fc, *head, layer, eps, qk_eps, heads, scale);
      return team_eagle_chain<float>(first, hidden, start, table, steps, keep_in, threshold, embed, inv_freq, *fc,
                                     *head, layer, eps, qk_eps, heads, scale);
    }
  }
  const auto rows = at::arange(batch, first.options());
  const auto ones = at::ones_like(first);
  std::vector<at::Tensor> drafts{first}, kept;
  at::Tensor g = hidden, keep = keep_in, draft = first;
  for (int64_t i = 1; i <= steps; ++i) {
    const at::Tensor embeds = embed.index_select(0, draft);          // checks each id against the vocabulary
    const at::Tensor x = layer_linear(at::cat({embeds, g.to(embeds.scalar_type())}, -1), fc_w, fc_b, fc_s, int8_max_rows);
    const at::Tensor kv_len = start + i;                    // the new token at position start + i - 1
    const at::Tensor rope = rope_table(rows, ones, kv_len, batch, inv_freq);
    g = listed_dense_layer(x, rope, k_cache, v_cache, rows, ones, kv_len, rows, table, w, eps, qk_eps, num_heads,
                           num_kv_heads, head_dim, scale, int8_max_rows);
    const at::Tensor logits = layer_linear(g, head_w, {}, head_s, int8_max_rows).to(at::kFloat);
    const auto [top, confidence] = top_choice(logits);
    keep = keep & confidence.lt(threshold).logical_not();
    if (!keep.any().item<bool>()) break;                    // no row verifies this draft: the chain ends
    drafts.push_back(top);
    kept.push_back(keep);
    draft = top;
  }
  return {at::stack(drafts, 1), kept.empty() ? at::zeros({0, batch}, keep_in.options()) : at::stack(kept, 0)};
}

// An EAGLE-1 head's extend in one call (spec/eagle_worker.py: EagleWorker.extend), what the head's
// modules compute from Python: every row's verified tokens (sequence b: tokens q_start[b] ..
// q_start[b] + q_len[b] - 1, at the positions before kv_len[b]) with the target's features,
//   g = dense_layer(linear(cat(embed[tokens], features), fc));
// then the rows `pick` of g (each sequence's last accepted position) are the next step's hidden states,
// and their greedy drafts with the softmax probability of each. Returns (hidden [B, H], drafts [B],
// probabilities [B]).
std::tuple<at::Tensor, at::Tensor, at::Tensor> eagle_extend(
    const at::Tensor& tokens, const at::Tensor& features, const at::Tensor& q_start, const at::Tensor& q_len,
    const at::Tensor& kv_len, const at::Tensor& rows, const at::Tensor& table, at::Tensor k_cache, at::Tensor v_cache,
    const at::Tensor& pick, const at::Tensor& embed, const at::Tensor& inv_freq, const at::Tensor& fc_w,
    const c10::optional<at::Tensor>& fc_b, const c10::optional<at::Tensor>& fc_s, const at::Tensor& head_w,
    const c10::optional<at::Tensor>& head_s, const std::vector<c10::optional<at::Tensor>>& w, double eps,
    double qk_eps, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale, int64_t int8_max_rows) {
  const int64_t n = tokens.numel(), seqs = q_start.numel();
  TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong && features.dim() == 2 && features.size(0) == n,
              "eagle_extend: tokens [T] and features [T, H] must agree");
  TORCH_CHECK(q_len.numel() == seqs && kv_len.numel() == seqs && rows.numel() == seqs && pick.numel() == seqs
              && pick.scalar_type() == at::kLong, "eagle_extend: q_start, q_len, kv_len, rows and pick must be [B]");
  check_layer_list(w, "eagle_extend");
  const at::Tensor embeds = embed.index_select(0, tokens);           // checks each id against the vocabulary
  const at::Tensor x = layer_linear(at::cat({embeds, features.to(embeds.scalar_type())}, -1), fc_w, fc_b, fc_s,
                                    int8_max_rows);
  const at::Tensor rope = rope_table(q_start, q_len, kv_len, n, inv_freq);
  const at::Tensor g = listed_dense_layer(x, rope, k_cache, v_cache, q_start, q_len, kv_len, rows, table, w, eps,
                                          qk_eps, num_heads, num_kv_heads, head_dim, scale, int8_max_rows)
                           .index_select(0, pick);                   // checks each pick against the tokens
  const auto [top, confidence] = top_choice(layer_linear(g, head_w, {}, head_s, int8_max_rows).to(at::kFloat));
  return {g, top, confidence};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is released while a kernel runs (the arguments are converted before, the result after):
  // the rank's event loop schedules the next batch meanwhile, as it does while torch's own operators run.
  const auto release = py::call_guard<py::gil_scoped_release>();
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension", release);
  m.def("add_rms_norm", &add_rms_norm, "(x + delta, RMSNorm(x + delta))", release);
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a stacked [T, 2I] gate|up", release);
  m.def("int8_linear", &int8_linear, "weight-only int8 linear, per-output-channel scales", release);
  m.def("linear", &float_linear, "x @ W^T (+ b): a few float32 rows natively, else torch's product", release);
  m.attr("FLOAT_LINEAR_MAX_ROWS") = FLOAT_LINEAR_MAX_ROWS;
  m.attr("HAS_BF16_PRODUCT") = HAS_BF16_PRODUCT;
  m.attr("HAS_TILE_PRODUCT") = HAS_TILE_PRODUCT;
  m.def("tile_pack", &tile_pack, "W [N, K] packed for the vector or tile products where they run (bf16: AMX tiles or "
        "AVX512-BF16 vectors; float32: AVX-512 vectors), else W");
  m.def("tile_unpack", &tile_unpack, "the [N, K] matrix of a packed weight");
  m.attr("HAS_F32_PACKED") = HAS_F32_PACKED;
  m.def("bf16_packed_run", &bf16_packed_run, "whether bf16 weights pack for packed_product here (AMX tiles or AVX512-BF16 vectors)");
  m.def("bf16_packed_products", &bf16_packed_products, "where packed_product runs on bf16: AMX tiles, AVX512-BF16 vectors, or '' (no packing)");
  m.def("set_native_float_products", &set_native_float_products, "off: float products through torch (benchmarks)");
  m.def("set_kv_prefetch", &set_kv_prefetch, "off: attention fetches no key or value row ahead (benchmarks)");
  m.def("set_float_prefetch", &set_float_prefetch, "off: the float product fetches no block ahead (benchmarks)");
  m.def("set_teams", &set_teams, "off: dense_layers opens a parallel region per loop, not one for the stack (benchmarks)");
  m.def("set_own_rows", &set_own_rows, "off: a team's row-wise steps spread across it at every row count (benchmarks)");
  m.def("team_chains_run", &team_chains_run, "EAGLE chains run in one parallel region since the module loaded");
  m.def("team_stacks_run", &team_stacks_run, "layer stacks run in one parallel region since the module loaded");
  m.def("set_wide_row_runs", &set_wide_row_runs, "off: the float vector passes read four rows at a time (benchmarks)");
  m.def("w8a8_linear", &w8a8_linear, "int8 weights against each row of x quantized to int8, int32 sums", release);
  m.def("w8a8_tiles_run", &w8a8_tiles_run, "whether w8a8_linear runs on AMX tiles here");
  m.def("w8a8_fast_run", &w8a8_fast_run, "whether w8a8_linear runs on AMX int8 tiles or AVX512-VNNI here (not the plain loop)");
  m.def("w8a8_products", &w8a8_products, "where w8a8_linear's sums are taken: AMX int8 tiles, AVX512-VNNI or a plain loop");
  m.def("set_w8a8_fast", &set_w8a8_fast, "off: w8a8_linear's plain loop, the same sums (tests, benchmarks)");
  m.attr("HAS_W8A8_TILES") = HAS_W8A8_TILES;
  m.attr("HAS_W8A8_VNNI") = HAS_W8A8_VNNI;
  m.def("int8_dequantize", &int8_dequantize, "a packed int8 weight as a [N, K] matrix", release);
  m.def("dense_layer", &dense_layer, "a dense decoder layer: norms, products, attention, SwiGLU", release);
  m.def("rope_table", &rope_table, "cos | sin of each token's position, for attention", release);
  m.def("dense_layers", &dense_layers, "every layer of a dense model, one dense_layer after another", release);
  m.def("moe_experts", &moe_experts, "the routed experts of a sparse MoE block, weighted and summed", release);
  m.def("top_choice", &top_choice, "each row's argmax and its softmax probability", release);
  m.def("eagle_chain", &eagle_chain, "an EAGLE-1 head's greedy draft chain, trimmed by confidence", release);
  m.def("eagle_extend", &eagle_extend, "an EAGLE-1 head's extend over the verified tokens, and its next first drafts", release);
  m.def("attention", &attention, "rotary + KV write + attention over the slot-indexed cache", release);
}
