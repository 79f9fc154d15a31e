#pragma once

#include "layers.h"

namespace tandem {

std::tuple<at::Tensor, at::Tensor> top_choice(const at::Tensor& logits_in);

std::tuple<at::Tensor, at::Tensor> eagle_chain(
    const at::Tensor& first, const at::Tensor& hidden, const at::Tensor& start, const at::Tensor& table,
    at::Tensor k_cache, at::Tensor v_cache, int64_t steps, const at::Tensor& keep_in, double threshold,
    const at::Tensor& embed, const at::Tensor& inv_freq, const at::Tensor& fc_w, const c10::optional<at::Tensor>& fc_b,
    const c10::optional<at::Tensor>& fc_s, const at::Tensor& head_w, const c10::optional<at::Tensor>& head_s,
    const LayerList& w, double eps, double qk_eps, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    double scale);

std::tuple<at::Tensor, at::Tensor, at::Tensor> eagle_extend(
    const at::Tensor& tokens, const at::Tensor& features, const at::Tensor& q_start, const at::Tensor& q_len,
    const at::Tensor& kv_len, const at::Tensor& rows, const at::Tensor& table, at::Tensor k_cache, at::Tensor v_cache,
    const at::Tensor& pick, const at::Tensor& embed, const at::Tensor& inv_freq, const at::Tensor& fc_w,
    const c10::optional<at::Tensor>& fc_b, const c10::optional<at::Tensor>& fc_s, const at::Tensor& head_w,
    const c10::optional<at::Tensor>& head_s, const LayerList& w, double eps, double qk_eps, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, double scale);

int64_t team_chains_run();

}  // namespace tandem
