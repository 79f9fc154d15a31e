// The products whose rows are quantized as they come (products.h has the layouts):
//
// - W8A8 (--quantization w8a8_int8): each row of x as int8 with one scale (max |x| / 127, rounded half to
//   even, as torch.round), int32 sums, y = float(sum) * x_scale[row] * w_scale[n] (+ bias). The sums are
//   exact, so every way of taking them (AMX tiles, AVX512-VNNI, AVX2, a plain loop; any batch) gives a row
//   the same values.
// - int4 (--quantization int4): weights in groups of 32 inputs with one float16 scale per (column, group),
//   stored as w + 8 in 0..15; each row's group of 32 as int8 with its scale and its sum (llama.cpp's q8_0
//   for the activations of its q4_0). Per group the int32 sum of (w + 8) * x less 8 * sum(x), exact, then
//   y = sum over groups in order of float(that) * (w_scale * x_scale) (+ bias): again the same for a row
//   whatever its batch.
#pragma once

#include "products.h"

namespace tandem {

bool is_w8a8_packed(const at::Tensor& w);
bool is_int4_packed(const at::Tensor& w, const at::Tensor& scale);

template <typename T>
void quantized_product_into(const T* x, int64_t rows, int64_t k_dim, const Weight& w, RowBuffers& buffers, T* y,
                            bool alone, const Weight* next);

std::string quantized_path(Format format);

// x [M, K] -> int8 rows as W8A8 quantizes them, and their scales (tests compare with the reference's).
std::tuple<at::Tensor, at::Tensor> quantize_rows_w8a8(const at::Tensor& x);

}  // namespace tandem
