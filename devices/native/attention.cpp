#include "attention.h"

#include <ATen/ops/mm.h>

#include "norms.h"

namespace tandem {

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
  auto q = empty({n_rows, dim}, opts), k = empty({keys, dim}, opts), v = empty({keys, dim}, opts);
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
  const int64_t ahead = tuning().kv_prefetch ? FETCH_AHEAD : last;      // `last`: nothing fetched ahead
  for (int64_t j = 0; j < last; j += 8) {
    const int64_t block = std::min<int64_t>(8, last - j);
    for (int64_t i = j + ahead; i < std::min(j + ahead + 8, last); ++i)
      fetch_row<T, dim>(keys + slots[i] * stride);
    Vec16 part[R][8];
    for (int i = 0; i < 8; ++i) {
      for (int r = 0; r < R; ++r) part[r][i] = zero();
      if (i < block) {
        const T* k = keys + slots[j + i] * stride;
        for (int v = 0; v < NV; ++v) {
          const Vec16 kv = load16(k + 16 * v);
          for (int r = 0; r < R; ++r) part[r][i] += q[r][v] * kv;
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      float dots[8];
      sum_lanes8(part[r], dots);                     // dots[i]: key j + i's dot alone
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
        if (j < visible[r]) acc[r][v] += splat(scores[r * keys_n + j]) * value;
    }
  }
  for (int r = 0; r < R; ++r) {
    const float norm = 1.f / total[r];
    float out[dim];
    for (int v = 0; v < NV; ++v) store16(out + 16 * v, acc[r][v]);
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

at::Tensor attention(const at::Tensor& qkv, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                     at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& q_start, const at::Tensor& q_len,
                     const at::Tensor& kv_len, const at::Tensor& rows, const at::Tensor& table,
                     const at::Tensor& rope, const c10::optional<at::Tensor>& q_norm,
                     const c10::optional<at::Tensor>& k_norm, double norm_eps, double scale) {
  check_attention(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, q_start, q_len, kv_len, rows, table, rope);
  auto out = empty({qkv.size(0), num_heads * head_dim}, qkv.options());
  auto queries = empty({qkv.size(0) * num_heads * head_dim}, qkv.options().dtype(at::kFloat));
  const Heads heads{num_heads, num_kv_heads, head_dim};
  c10::optional<at::Tensor> qn, kn;
  if (q_norm) qn = q_norm->contiguous();
  if (k_norm) kn = k_norm->contiguous();
  TANDEM_DISPATCH(qkv.scalar_type(), "attention", [&] {
    attention_impl<scalar_t>(qkv, heads, k_cache, v_cache, q_start, q_len, kv_len, rows, table, rope, qn, kn,
                             norm_eps, scale, out, queries.data_ptr<float>());
  });
  return out;
}

template void attention_impl<float>(const at::Tensor&, const Heads&, at::Tensor&, at::Tensor&, const at::Tensor&,
                                    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    const at::Tensor&, const c10::optional<at::Tensor>&,
                                    const c10::optional<at::Tensor>&, double, double, at::Tensor&, float*);
template void attention_impl<c10::BFloat16>(const at::Tensor&, const Heads&, at::Tensor&, at::Tensor&,
                                            const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                            const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                            const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
                                            double, double, at::Tensor&, float*);

}  // namespace tandem
