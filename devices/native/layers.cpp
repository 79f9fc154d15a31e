#include "layers.h"

#include <ATen/ops/add.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros_like.h>

#include "norms.h"

namespace tandem {

std::atomic<int64_t> team_stacks{0};      // stacks run in a team since the module loaded (tests)
int64_t team_stacks_run() { return team_stacks.load(); }

void check_layer_list(const LayerList& w, const char* caller) {
  TORCH_CHECK(w.size() == 16 && w[1] && w[2] && w[5] && w[8] && w[11], caller, ": a layer is malformed");
}

c10::optional<Weight> team_product(const c10::optional<at::Tensor>& w, const c10::optional<at::Tensor>& b,
                                   const c10::optional<at::Tensor>& s, int64_t width, at::ScalarType dtype) {
  if (!w || !is_packed(*w, s) || !w->is_contiguous()) return c10::nullopt;
  if (!s && !tuning().native_products) return c10::nullopt;
  if (!s && w->scalar_type() != dtype) return c10::nullopt;
  return weight_of(*w, s, b, width, dtype, "dense_layers");
}

std::vector<TeamLayer> team_layers(at::ScalarType dtype, int64_t hidden, const std::vector<at::Tensor>& k_caches,
                                   const std::vector<at::Tensor>& v_caches, const std::vector<LayerList>& layers,
                                   const Heads& heads) {
  if ((dtype != at::kBFloat16 && dtype != at::kFloat) || at::get_num_threads() < 2 || layers.empty()) return {};
  std::vector<TeamLayer> team;
  const int64_t attended = heads.q * heads.dim;
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto& w = layers[i];
    const auto qkv = team_product(w[2], w[3], w[4], hidden, dtype);
    const auto o = team_product(w[5], w[6], w[7], attended, dtype);
    const auto gate_up = team_product(w[8], w[9], w[10], hidden, dtype);
    if (!qkv || !o || !gate_up) return {};
    const auto down = team_product(w[11], w[12], w[13], gate_up->n_dim / 2, dtype);
    if (!down) return {};
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
    TORCH_CHECK(layer.qkv.n_dim == (heads.q + 2 * heads.kv) * heads.dim, "dense_layers: the qkv product gives ",
                layer.qkv.n_dim, " values, not (", heads.q, " + 2 * ", heads.kv, ") * ", heads.dim);
    TORCH_CHECK(layer.o.n_dim == hidden && layer.down.n_dim == hidden, "dense_layers: o and down must give ", hidden, " values");
    TORCH_CHECK(layer.gate_up.n_dim == 2 * inter, "dense_layers: every layer's gate|up must give ", 2 * inter, " values");
  }
  return team;
}

TeamShared::TeamShared(int64_t tokens_, int64_t hidden_, const std::vector<TeamLayer>& layers, const Heads& heads,
                       const at::TensorOptions& opts, int64_t other_k_padded)
    : tokens(tokens_), hidden(hidden_), inter(layers[0].gate_up.n_dim / 2), k_padded(other_k_padded),
      own_rows(tuning().own_rows && tokens_ <= OWN_ROWS) {
  for (const auto& layer : layers)
    for (const auto* p : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down}) k_padded = std::max(k_padded, p->k_padded);
  for (auto* t : {&stream[0], &stream[1], &normed, &post, &h, &delta}) *t = empty({tokens, hidden}, opts);
  qkv = empty({tokens, layers[0].qkv.n_dim}, opts);
  attended = empty({tokens, heads.q * heads.dim}, opts);
  gate_up = empty({tokens, 2 * inter}, opts);
  act = empty({tokens, inter}, opts);
  queries = empty({tokens * heads.q * heads.dim}, opts.dtype(at::kFloat));
  if (!own_rows) rows = RowBuffers(tokens, k_padded);
}

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
    const Weight* next_qkv = i + 1 < layers.size() ? &layers[i + 1].qkv : nullptr;
    team_linear(layer.input_norm.defined() ? mine.normed : x, tokens, hidden, layer.qkv, mine, sh.qkv.data_ptr<T>(),
                own_rows, &layer.o);
    attention_impl<T>(sh.qkv, batch.heads, k_cache, v_cache, batch.q_start, batch.q_len, batch.kv_len, batch.rows,
                      batch.table, batch.rope, layer.q_norm, layer.k_norm, batch.qk_eps, batch.scale, out,
                      sh.queries.data_ptr<float>());
    team_linear(sh.attended.data_ptr<T>(), tokens, batch.heads.q * batch.heads.dim, layer.o, mine, dp, own_rows,
                &layer.gate_up);
    add_rms_norm_into(x, dp, layer.post_norm.data_ptr<T>(), mine.h, mine.post, tokens, hidden, eps, own_rows);
    team_linear(mine.post, tokens, hidden, layer.gate_up, mine, gp, own_rows, &layer.down);
    silu_mul_into(gp, 2 * inter, mine.act, tokens, inter, own_rows);
    team_linear(mine.act, tokens, inter, layer.down, mine, dp, own_rows, next_qkv);
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

template const float* team_layers_run<float>(const float*, const std::vector<TeamLayer>&, const TeamShared&,
                                             TeamRows<float>&, const TeamBatch&);
template const c10::BFloat16* team_layers_run<c10::BFloat16>(const c10::BFloat16*, const std::vector<TeamLayer>&,
                                                             const TeamShared&, TeamRows<c10::BFloat16>&,
                                                             const TeamBatch&);

// dense_layers with every thread in one region for the whole stack (Team): the same kernels on the same
// rows, so the same values as layer after layer, region after region.
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
                                        const at::Tensor& table, const std::vector<LayerList>& layers, double eps,
                                        double qk_eps, const Heads& heads, double scale) {
  if (!tuning().teams || layers.empty() || x_in.numel() == 0) return c10::nullopt;
  const auto team = team_layers(x_in.scalar_type(), x_in.size(-1), k_caches, v_caches, layers, heads);
  if (team.empty()) return c10::nullopt;
  const TeamBatch batch{rope, q_start, q_len, kv_len, rows, table, static_cast<float>(eps), qk_eps, scale, heads};
  if (x_in.scalar_type() == at::kBFloat16) return team_dense_layers<c10::BFloat16>(x_in, team, batch);
  return team_dense_layers<float>(x_in, team, batch);
}

// One pre-norm decoder layer: h = x + o(attention(qkv(norm(x)))); out = h + down(silu(gate) * up)(norm(h)).
// The functions the layer's modules call one by one from Python, without a Python call between them; in one
// parallel region where a team runs it (stack_in_team).
at::Tensor dense_layer(const at::Tensor& x, const at::Tensor& rope, at::Tensor k_cache, at::Tensor v_cache,
                       const at::Tensor& q_start, const at::Tensor& q_len, const at::Tensor& kv_len,
                       const at::Tensor& rows, const at::Tensor& table, const LayerList& w, double eps,
                       double qk_eps, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale) {
  check_layer_list(w, "dense_layer");
  const Heads heads{num_heads, num_kv_heads, head_dim};
  if (auto out = stack_in_team(x, rope, {k_cache}, {v_cache}, q_start, q_len, kv_len, rows, table, {w}, eps, qk_eps,
                               heads, scale))
    return *out;
  const at::Tensor normed = w[0] ? rms_norm(x, *w[0], eps) : x;
  const at::Tensor qkv = linear(normed, *w[2], w[3], w[4]);
  const at::Tensor attended = attention(qkv, num_heads, num_kv_heads, head_dim, k_cache, v_cache, q_start, q_len,
                                        kv_len, rows, table, rope, w[14], w[15], qk_eps, scale);
  const auto [h, post] = add_rms_norm(x, linear(attended, *w[5], w[6], w[7]), *w[1], eps);
  const at::Tensor act = silu_mul(linear(post, *w[8], w[9], w[10]));
  return at::add(h, linear(act, *w[11], w[12], w[13]));
}

// Every layer of a dense model in one call (dense_layer after dense_layer, the residual stream in between):
// the stream runs the whole stack without coming back to Python.
at::Tensor dense_layers(const at::Tensor& x_in, const at::Tensor& rope, std::vector<at::Tensor> k_caches,
                        std::vector<at::Tensor> v_caches, const at::Tensor& q_start, const at::Tensor& q_len,
                        const at::Tensor& kv_len, const at::Tensor& rows, const at::Tensor& table,
                        const std::vector<LayerList>& layers, double eps, double qk_eps, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, double scale) {
  TORCH_CHECK(k_caches.size() == layers.size() && v_caches.size() == layers.size(),
              "dense_layers: one K and one V cache per layer");
  for (const auto& layer : layers) check_layer_list(layer, "dense_layers");
  const Heads heads{num_heads, num_kv_heads, head_dim};
  if (auto out = stack_in_team(x_in, rope, k_caches, v_caches, q_start, q_len, kv_len, rows, table, layers, eps,
                               qk_eps, heads, scale))
    return *out;
  at::Tensor x = x_in;
  for (size_t i = 0; i < layers.size(); ++i)
    x = dense_layer(x, rope, k_caches[i], v_caches[i], q_start, q_len, kv_len, rows, table, layers[i], eps, qk_eps,
                    num_heads, num_kv_heads, head_dim, scale);
  return x;
}

// The experts of a sparse MoE block (engine/models/moe.py: StackedExperts) in one call: for each held
// expert e (ids first .. first + E - 1) with routed pairs, its tokens' rows run gate_up[e], SwiGLU and
// down[e] (linear's products), and out[t] = sum over t's pairs, in expert order, of weight * output, each
// product and sum rounded to the dtype: what the grouped pure-torch path computes with one Python
// iteration and some ten operators per expert.
at::Tensor moe_experts(const at::Tensor& x_in, const at::Tensor& expert_ids_in, const at::Tensor& weights_in,
                       const at::Tensor& gate_up, const at::Tensor& down, int64_t first) {
  const auto x = x_in.contiguous();
  check_cpu_rows(x, "x");
  const auto expert_ids = expert_ids_in.to(at::kLong).contiguous();
  const auto weights = weights_in.to(at::kFloat).contiguous();
  const int64_t tokens = x.size(0), top_k = expert_ids.size(1), experts = gate_up.size(0);
  TORCH_CHECK(expert_ids.dim() == 2 && expert_ids.size(0) == tokens && weights.sizes() == expert_ids.sizes(),
              "moe_experts: expert_ids and weights must be [tokens, top_k]");
  // a stack of [N, K] matrices, or of packed ones (pack_float: bf16 [E, N/16, K/32, 16, 16, 2], float32
  // [E, N/16, K, 16])
  auto stacked = [](const at::Tensor& t) { return t.dim() == 3 || (t.dim() > 3 && is_float_packed(t[0])); };
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
                                               : at::index_select(x, 0, at::tensor(rows, x.options().dtype(at::kLong)));
    const at::Tensor y = linear(silu_mul(linear(inputs, gate_up[e], {}, {})), down[e], {}, {}).contiguous();
    TANDEM_DISPATCH(x.scalar_type(), "moe_experts", [&] {
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

}  // namespace tandem
