// Attention over the slot-indexed KV cache: the rotary embedding applied, the new keys and values written
// into their slots, and each sequence's cached keys read in place (no gather into a padded batch, no mask).
//
// Layout (engine/models/attention.py: SeqLayout): sequence b owns tokens q_start[b] .. q_start[b] +
// q_len[b] of the batch; its kv_len[b] positions include them, so token i of b sits at position kv_len[b] -
// q_len[b] + i and sees keys 0 ..= that position. table[rows[b]][p] is the KV slot of position p of b.
#pragma once

#include "common.h"

namespace tandem {

// attention's arguments checked: qkv [T, (H + 2 Hkv) * D], the caches, lengths, table and rope.
void check_attention(const at::Tensor& qkv, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                     const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& q_start,
                     const at::Tensor& q_len, const at::Tensor& kv_len, const at::Tensor& rows,
                     const at::Tensor& table, const at::Tensor& rope);

// The attention of qkv's rows into out [T, H * D] (checked before: check_attention); `queries` is
// float scratch of T * H * D. Its loop is spread: in a team each thread takes its share of the jobs.
template <typename T>
void attention_impl(const at::Tensor& qkv, const Heads& heads, at::Tensor& k_cache, at::Tensor& v_cache,
                    const at::Tensor& q_start, const at::Tensor& q_len, const at::Tensor& kv_len,
                    const at::Tensor& rows, const at::Tensor& table, const at::Tensor& rope,
                    const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                    double norm_eps, double scale, at::Tensor& out, float* queries);

// qkv [T, (H + 2 Hkv) * D] (the stacked projection's output); returns [T, H * D].
at::Tensor attention(const at::Tensor& qkv, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                     at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& q_start, const at::Tensor& q_len,
                     const at::Tensor& kv_len, const at::Tensor& rows, const at::Tensor& table,
                     const at::Tensor& rope, const c10::optional<at::Tensor>& q_norm,
                     const c10::optional<at::Tensor>& k_norm, double norm_eps, double scale);

}  // namespace tandem
