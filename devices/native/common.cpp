#include "common.h"

#include <ATen/ops/empty.h>

namespace tandem {

Tuning& tuning() {
  static Tuning record;
  return record;
}

std::vector<std::pair<std::string, std::atomic<bool>*>> tuning_switches() {
  Tuning& t = tuning();
  return {{"teams", &t.teams},           {"own_rows", &t.own_rows},         {"wide_row_runs", &t.wide_row_runs},
          {"kv_prefetch", &t.kv_prefetch}, {"isa_products", &t.isa_products}, {"native_products", &t.native_products},
          {"paired_blocks", &t.paired_blocks}, {"widen_once", &t.widen_once}, {"weight_prefetch", &t.weight_prefetch}};
}

thread_local const Team* current_team = nullptr;

void check_cpu_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, width] with unit stride along the width");
}

at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) { return at::empty(sizes, options); }

}  // namespace tandem
