// Row-wise steps of a decoder layer: RMSNorm (alone and after the residual add), SwiGLU's silu(gate) * up,
// the residual add, and the rotary embedding. The *_into forms work on raw rows, shared out with row_loop
// (all rows on this thread where `alone`: a team's own rows), for the layer stacks; norms.cpp has the
// tensor entry points.
#pragma once

#include "common.h"

namespace tandem {

// out = weight * (x / rms(x)), normalized in float32 and rounded to the input dtype before the
// weight (as the pure-torch RMSNorm and Hugging Face do).
template <typename T>
void rms_norm_row(const T* x, const T* weight, T* out, int64_t width, float eps) {
  float sum = 0.f;
_Pragma("omp simd reduction(+ : sum)")
  for (int64_t j = 0; j < width; ++j) sum += to_float(x[j]) * to_float(x[j]);
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(width) + eps);
  for (int64_t j = 0; j < width; ++j) {
    const T normed = round_to<T>(to_float(x[j]) * inv);
    out[j] = round_to<T>(to_float(weight[j]) * to_float(normed));
  }
}

template <typename T>
void rms_norm_into(const T* x, const T* weight, T* out, int64_t rows, int64_t width, float eps, bool alone = false) {
  row_loop(rows, 16, alone, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(x + r * width, weight, out + r * width, width, eps);
  });
}

// h = x + delta (rounded to T), out = norm(h): the residual add and the next RMSNorm in one pass.
template <typename T>
void add_rms_norm_into(const T* x, const T* delta, const T* weight, T* h, T* out, int64_t rows, int64_t width,
                       float eps, bool alone = false) {
  row_loop(rows, 16, alone, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t j = 0; j < width; ++j) h[r * width + j] = round_to<T>(to_float(x[r * width + j]) + to_float(delta[r * width + j]));
      rms_norm_row(h + r * width, weight, out + r * width, width, eps);
    }
  });
}

// out = x + delta, rounded to T (the residual add after the last layer, or before a layer without an
// input norm).
template <typename T>
void add_into(const T* x, const T* delta, T* out, int64_t rows, int64_t width, bool alone = false) {
  row_loop(rows, 16, alone, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * width; i < end * width; ++i) out[i] = round_to<T>(to_float(x[i]) + to_float(delta[i]));
  });
}

// [rows, 2I] (gate | up, rows `stride` apart) -> [rows, I]: silu(gate) * up, each rounded to T as torch's
// two operators do.
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

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x_in, const at::Tensor& delta_in,
                                                const at::Tensor& weight, double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor rope_table(const at::Tensor& q_start, const at::Tensor& q_len, const at::Tensor& kv_len, int64_t tokens,
                      const at::Tensor& inv_freq);

}  // namespace tandem
