// The draft steps of an EAGLE-1 head in one native call each: a step's choice (each row's argmax and its
// probability), the greedy draft chain, and the extend over the verified tokens.
#include <ATen/ops/add.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/logical_and.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>

#include "draft.h"
#include "norms.h"

namespace tandem {

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
  auto top = empty({rows}, logits.options().dtype(at::kLong));
  auto confidence = empty({rows}, logits.options());
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
    const Weight& fc, const Weight& head, const std::vector<TeamLayer>& layer, double eps, double qk_eps,
    const Heads& heads, double scale) {
  const int64_t batch = first.numel(), width = fc.n_dim, e_width = embed.size(1), vocab = head.n_dim;
  const int64_t* first_ids = first.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(first_ids[b] >= 0 && first_ids[b] < embed.size(0), "eagle_chain: draft ", first_ids[b],
                " outside the vocabulary (", embed.size(0), ")");
  const auto dtype = embed.scalar_type();
  TORCH_CHECK(hidden.size(1) == width && vocab <= embed.size(0), "eagle_chain: hidden [B, ", width, "] and an LM head "
              "over at most the vocabulary");
  const at::Tensor g0 = hidden.to(dtype).contiguous();
  const at::Tensor rows = at::arange(batch, first.options()), ones = at::ones_like(first);
  std::vector<at::Tensor> kv_lens, ropes;                // each step's positions, made before the region
  for (int64_t i = 1; i <= steps; ++i) {
    kv_lens.push_back(at::add(start, i));                          // the new token at position start + i - 1
    ropes.push_back(rope_table(rows, ones, kv_lens.back(), batch, inv_freq));
  }
  const TeamShared sh(batch, width, layer, heads, embed.options(), std::max(fc.k_padded, head.k_padded));
  for (int64_t i = 0; i < steps; ++i)
    check_attention(sh.qkv, heads.q, heads.kv, heads.dim, layer[0].k_cache, layer[0].v_cache, rows, ones, kv_lens[i],
                    rows, table, ropes[i]);
  at::Tensor fc_out = empty({batch, width}, embed.options()), logits = empty({batch, vocab}, embed.options());
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
      team_linear(x.data(), batch, e_width + width, fc, mine, fc_out.data_ptr<T>(), true);
      const TeamBatch step{ropes[i - 1], rows, ones, kv_lens[i - 1], rows, table, static_cast<float>(eps), qk_eps,
                           scale, heads};
      g = team_layers_run(fc_out.data_ptr<T>(), layer, sh, mine, step);
      team_linear(g, batch, width, head, mine, logits.data_ptr<T>(), true);
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
  auto out = empty({batch, 1 + m}, first.options());
  auto kept_out = empty({m, batch}, keep_in.options());
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
    const LayerList& w, double eps, double qk_eps, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, double scale) {
  const int64_t batch = first.numel();
  TORCH_CHECK(first.dim() == 1 && first.scalar_type() == at::kLong && hidden.dim() == 2 && hidden.size(0) == batch
              && start.sizes() == first.sizes() && start.scalar_type() == at::kLong && table.dim() == 2
              && table.size(0) == batch && keep_in.sizes() == first.sizes() && keep_in.scalar_type() == at::kBool,
              "eagle_chain: first, start, keep [B], hidden [B, H] and table [B, W] must agree");
  check_layer_list(w, "eagle_chain");
  TORCH_CHECK(steps >= 0, "eagle_chain: steps must be >= 0");
  const auto dtype = embed.scalar_type();
  if (tuning().teams && tuning().own_rows && steps > 0 && batch > 0 && batch <= OWN_ROWS &&
      (dtype == at::kBFloat16 || dtype == at::kFloat) && first.is_contiguous() && keep_in.is_contiguous() &&
      embed.is_contiguous() && embed.dim() == 2) {
    const Heads heads{num_heads, num_kv_heads, head_dim};
    const int64_t width = hidden.size(1);
    const auto fc = team_product(fc_w, fc_b, fc_s, embed.size(1) + width, dtype);
    const auto head = team_product(head_w, {}, head_s, width, dtype);
    const auto layer = fc && head ? team_layers(dtype, width, {k_cache}, {v_cache}, {w}, heads) : std::vector<TeamLayer>{};
    if (!layer.empty() && fc->n_dim == width) {
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
    const at::Tensor embeds = at::index_select(embed, 0, draft);     // checks each id against the vocabulary
    const at::Tensor x = linear(at::cat({embeds, g.to(embeds.scalar_type())}, -1), fc_w, fc_b, fc_s);
    const at::Tensor kv_len = at::add(start, i);            // the new token at position start + i - 1
    const at::Tensor rope = rope_table(rows, ones, kv_len, batch, inv_freq);
    g = dense_layer(x, rope, k_cache, v_cache, rows, ones, kv_len, rows, table, w, eps, qk_eps, num_heads,
                    num_kv_heads, head_dim, scale);
    const at::Tensor logits = linear(g, head_w, {}, head_s).to(at::kFloat);
    const auto [top, confidence] = top_choice(logits);
    keep = at::logical_and(keep, confidence.lt(threshold).logical_not());
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
    const c10::optional<at::Tensor>& head_s, const LayerList& w, double eps,
    double qk_eps, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale) {
  const int64_t n = tokens.numel(), seqs = q_start.numel();
  TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong && features.dim() == 2 && features.size(0) == n,
              "eagle_extend: tokens [T] and features [T, H] must agree");
  TORCH_CHECK(q_len.numel() == seqs && kv_len.numel() == seqs && rows.numel() == seqs && pick.numel() == seqs
              && pick.scalar_type() == at::kLong, "eagle_extend: q_start, q_len, kv_len, rows and pick must be [B]");
  check_layer_list(w, "eagle_extend");
  const at::Tensor embeds = at::index_select(embed, 0, tokens);      // checks each id against the vocabulary
  const at::Tensor x = linear(at::cat({embeds, features.to(embeds.scalar_type())}, -1), fc_w, fc_b, fc_s);
  const at::Tensor rope = rope_table(q_start, q_len, kv_len, n, inv_freq);
  const at::Tensor g = at::index_select(dense_layer(x, rope, k_cache, v_cache, q_start, q_len, kv_len, rows, table, w,
                                                    eps, qk_eps, num_heads, num_kv_heads, head_dim, scale),
                                        0, pick);                    // checks each pick against the tokens
  const auto [top, confidence] = top_choice(linear(g, head_w, {}, head_s).to(at::kFloat));
  return {g, top, confidence};
}

}  // namespace tandem
