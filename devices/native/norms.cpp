#include "norms.h"

#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>

namespace tandem {

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps) {
  const auto x = x_in.reshape({-1, x_in.size(-1)}).contiguous();
  auto out = at::empty_like(x);
  const int64_t rows = x.size(0), width = x.size(1);
  TORCH_CHECK(weight.numel() == width && weight.scalar_type() == x.scalar_type(), "rms_norm: weight must be [", width, "] of the input's dtype");
  const auto w = weight.contiguous();
  TANDEM_DISPATCH(x.scalar_type(), "rms_norm", [&] {
    rms_norm_into(x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, width,
                  static_cast<float>(eps));
  });
  return out.view(x_in.sizes());
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x_in, const at::Tensor& delta_in,
                                                const at::Tensor& weight, double eps) {
  const auto x = x_in.reshape({-1, x_in.size(-1)}).contiguous();
  const auto delta = delta_in.reshape({-1, x_in.size(-1)}).contiguous();
  TORCH_CHECK(x.sizes() == delta.sizes() && x.scalar_type() == delta.scalar_type(), "add_rms_norm: x and delta differ");
  auto h = at::empty_like(x);
  auto out = at::empty_like(x);
  const int64_t rows = x.size(0), width = x.size(1);
  TORCH_CHECK(weight.numel() == width && weight.scalar_type() == x.scalar_type(), "add_rms_norm: weight must be [", width, "] of the input's dtype");
  const auto w = weight.contiguous();
  TANDEM_DISPATCH(x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_into(x.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(),
                      h.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, width, static_cast<float>(eps));
  });
  return {h.view(x_in.sizes()), out.view(x_in.sizes())};
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_cpu_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * inter, "silu_mul: the width must be even");
  auto out = empty({rows, inter}, gate_up.options());
  TANDEM_DISPATCH(gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_into(gate_up.data_ptr<scalar_t>(), gate_up.stride(0), out.data_ptr<scalar_t>(), rows, inter);
  });
  return out;
}

// [T, head_dim] float32: row t is cos | sin of position(t) * inv_freq (see attention.h's layout),
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

}  // namespace tandem
