// Decoder layers in one native call: one pre-norm dense layer (engine/models/llama.py: DecoderLayer with a
// GatedMLP), the whole stack, and an MoE block's routed experts. Where every product of the stack is packed
// (products.h) and the activations are float32 or bf16, the stack runs in one parallel region (a Team):
// every thread runs the host code, each loop is its share then a barrier, and the values are those of a
// region per loop. The draft chains (draft.cpp) run their head's layer the same way.
#pragma once

#include "attention.h"
#include "products.h"

namespace tandem {

// A layer's tensors as one list, in dense_layer's order (input_norm, post_norm, qkv w/b/s, o w/b/s, gate_up
// w/b/s, down w/b/s, q_norm, k_norm; absent ones None).
using LayerList = std::vector<c10::optional<at::Tensor>>;
void check_layer_list(const LayerList& w, const char* caller);

struct TeamLayer {
  at::Tensor input_norm, post_norm, k_cache, v_cache;
  c10::optional<at::Tensor> q_norm, k_norm;
  Weight qkv, o, gate_up, down;
};

// The packed weight (w, b, s) as a team runs it for x of `width` values of `dtype`, or nullopt where the
// product runs otherwise (a weight as loaded: torch's product).
c10::optional<Weight> team_product(const c10::optional<at::Tensor>& w, const c10::optional<at::Tensor>& b,
                                   const c10::optional<at::Tensor>& s, int64_t width, at::ScalarType dtype);

// The layers as a team runs them over rows of `hidden` values of `dtype` (every product packed, the shapes
// checked), or an empty list where the stack runs region by region.
std::vector<TeamLayer> team_layers(at::ScalarType dtype, int64_t hidden, const std::vector<at::Tensor>& k_caches,
                                   const std::vector<at::Tensor>& v_caches, const std::vector<LayerList>& layers,
                                   const Heads& heads);

// The buffers a team's layers share over `tokens` rows (allocated before the region).
struct TeamShared {
  int64_t tokens, hidden, inter, k_padded;
  bool own_rows;                     // a few rows: the row-wise steps each thread's own (OWN_ROWS)
  at::Tensor stream[2], normed, post, h, delta, qkv, attended, gate_up, act, queries;
  mutable RowBuffers rows;           // the products' prepared rows, where shared

  TeamShared(int64_t tokens, int64_t hidden, const std::vector<TeamLayer>& layers, const Heads& heads,
             const at::TensorOptions& opts, int64_t other_k_padded = 1);    // other products' inputs
};

// One thread's view of a team's buffers: where own_rows, its own copies of the rows the row-wise steps
// write (the stream, its norms, h, SwiGLU's output, the products' prepared rows); else the shared ones.
template <typename T>
struct TeamRows {
  std::vector<T> own;
  RowBuffers own_buffers;
  T *normed, *h, *post, *act, *own_x;
  RowBuffers* buffers;

  explicit TeamRows(const TeamShared& sh)
      : own(sh.own_rows ? sh.tokens * (4 * sh.hidden + sh.inter) : 0),
        own_buffers(sh.own_rows ? sh.tokens : 0, sh.k_padded) {
    normed = sh.own_rows ? own.data() : sh.normed.data_ptr<T>();
    h = sh.own_rows ? normed + sh.tokens * sh.hidden : sh.h.data_ptr<T>();
    post = sh.own_rows ? h + sh.tokens * sh.hidden : sh.post.data_ptr<T>();
    act = sh.own_rows ? post + sh.tokens * sh.hidden : sh.act.data_ptr<T>();
    own_x = sh.own_rows ? act + sh.tokens * sh.inter : nullptr;
    buffers = sh.own_rows ? &own_buffers : &sh.rows;
  }
};

// Where a batch's sequences sit (attention's layout) and the model's attention scalars.
struct TeamBatch {
  const at::Tensor &rope, &q_start, &q_len, &kv_len, &rows, &table;
  float eps;
  double qk_eps, scale;
  Heads heads;
};

// y = x . w in a team: the rows prepared into the thread's own buffers where own_rows; `next` the product
// the team runs after it (product_into).
template <typename T>
void team_linear(const T* x, int64_t rows, int64_t k_dim, const Weight& w, TeamRows<T>& mine, T* y, bool own_rows,
                 const Weight* next = nullptr) {
  product_into(x, rows, k_dim, w, *mine.buffers, y, own_rows, next);
}

// The layers over x [tokens, hidden] (every thread reads it) inside a team region, run by every thread;
// returns the stream after the last layer (the thread's own where own_rows, else a shared buffer).
template <typename T>
const T* team_layers_run(const T* x, const std::vector<TeamLayer>& layers, const TeamShared& sh, TeamRows<T>& mine,
                         const TeamBatch& batch);

at::Tensor dense_layer(const at::Tensor& x, const at::Tensor& rope, at::Tensor k_cache, at::Tensor v_cache,
                       const at::Tensor& q_start, const at::Tensor& q_len, const at::Tensor& kv_len,
                       const at::Tensor& rows, const at::Tensor& table, const LayerList& w, double eps,
                       double qk_eps, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale);

at::Tensor dense_layers(const at::Tensor& x_in, const at::Tensor& rope, std::vector<at::Tensor> k_caches,
                        std::vector<at::Tensor> v_caches, const at::Tensor& q_start, const at::Tensor& q_len,
                        const at::Tensor& kv_len, const at::Tensor& rows, const at::Tensor& table,
                        const std::vector<LayerList>& layers, double eps, double qk_eps, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, double scale);

at::Tensor moe_experts(const at::Tensor& x_in, const at::Tensor& expert_ids_in, const at::Tensor& weights_in,
                       const at::Tensor& gate_up, const at::Tensor& down, int64_t first);

int64_t team_stacks_run();

}  // namespace tandem
