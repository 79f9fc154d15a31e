// The module's Python face (devices/cpu_native.py builds and loads it).
#include <torch/extension.h>

#include "draft.h"
#include "norms.h"
#include "quantized.h"

namespace tandem {
namespace {

// What the build targets, as the compiler saw it: tests and the start-up log key on this, never on the
// machine the tests run on.
py::dict build_features() {
  py::dict f;
  f["arch"] = TANDEM_X86 ? "x86_64" :
#if defined(__aarch64__)
      "aarch64";
#else
      "other";
#endif
  f["vector_bits"] = VECTOR_BYTES * 8;
  f["vector_registers"] = VECTOR_REGISTERS;
#define FEATURE(name, macro) f[name] = macro;
#if defined(__AVX2__)
  FEATURE("avx2", true)
#else
  FEATURE("avx2", false)
#endif
#if defined(__FMA__) || defined(__aarch64__)
  FEATURE("fma", true)
#else
  FEATURE("fma", false)
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
  FEATURE("avx512", true)
#else
  FEATURE("avx512", false)
#endif
#if defined(__AVX512BF16__)
  FEATURE("avx512_bf16", true)
#else
  FEATURE("avx512_bf16", false)
#endif
#if defined(__AVX512VNNI__)
  FEATURE("avx512_vnni", true)
#else
  FEATURE("avx512_vnni", false)
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  FEATURE("amx_bf16", true)
#else
  FEATURE("amx_bf16", false)
#endif
#if defined(__AMX_INT8__)
  FEATURE("amx_int8", true)
#else
  FEATURE("amx_int8", false)
#endif
#if defined(__F16C__) || defined(__aarch64__)
  FEATURE("f16c", true)
#else
  FEATURE("f16c", false)
#endif
#undef FEATURE
  return f;
}

py::dict tuning_record() {
  py::dict out;
  for (const auto& [name, flag] : tuning_switches()) out[name.c_str()] = flag->load();
  return out;
}

// set_tuning(teams=False, ...): each name a Tuning switch; returns the record as it was, for restoring.
py::dict set_tuning(const py::kwargs& switches) {
  py::dict before = tuning_record();
  auto known = tuning_switches();
  for (const auto& item : switches) {
    const auto name = item.first.cast<std::string>();
    auto it = std::find_if(known.begin(), known.end(), [&](const auto& k) { return k.first == name; });
    TORCH_CHECK(it != known.end(), "set_tuning: no switch named ", name);
    it->second->store(item.second.cast<bool>());
  }
  return before;
}

Format format_named(const std::string& name) {
  if (name == "float32") return Format::Float32;
  if (name == "bfloat16") return Format::Bfloat16;
  if (name == "int8") return Format::Int8;
  if (name == "w8a8_int8") return Format::W8A8;
  if (name == "int4") return Format::Int4;
  TORCH_CHECK(false, "product_path: no format named ", name);
}

}  // namespace
}  // namespace tandem

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace tandem;
  // The GIL is released while a kernel runs (the arguments are converted before, the result after): the
  // rank's event loop schedules the next batch meanwhile, as it does while torch's own operators run.
  const auto release = py::call_guard<py::gil_scoped_release>();
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension", release);
  m.def("add_rms_norm", &add_rms_norm, "(x + delta, RMSNorm(x + delta))", release);
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a stacked [T, 2I] gate|up", release);
  m.def("rope_table", &rope_table, "cos | sin of each token's position, for attention", release);
  m.def("attention", &attention, "rotary + KV write + attention over the slot-indexed cache", release);
  m.def("linear", &linear, "x . W (+ bias): a packed weight (with its scale where quantized) natively, else torch's "
        "product", py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(), py::arg("scale") = py::none(), release);
  m.def("pack_float", &pack_float, "W [N, K] (or [E, N, K]) packed for the native float products, else W");
  m.def("unpack_float", &unpack_float, "the [N, K] matrix of a packed float weight");
  m.def("is_packed", &is_packed, "whether (weight, scale) is in one of the packed formats",
        py::arg("weight"), py::arg("scale") = py::none());
  m.def("quantize_rows_w8a8", &quantize_rows_w8a8, "x's rows as W8A8 quantizes them, and their scales", release);
  m.def("dense_layer", &dense_layer, "a dense decoder layer: norms, products, attention, SwiGLU", release);
  m.def("dense_layers", &dense_layers, "every layer of a dense model, one dense_layer after another", release);
  m.def("moe_experts", &moe_experts, "the routed experts of a sparse MoE block, weighted and summed", release);
  m.def("top_choice", &top_choice, "each row's argmax and its softmax probability", release);
  m.def("eagle_chain", &eagle_chain, "an EAGLE-1 head's greedy draft chain, trimmed by confidence", release);
  m.def("eagle_extend", &eagle_extend, "an EAGLE-1 head's extend over the verified tokens, and its next first drafts",
        release);
  m.def("build_features", &build_features, "what the build targets (compile time): arch, vector width, ISA extensions");
  m.def("tuning", &tuning_record, "the tuning record's switches");
  m.def("set_tuning", &set_tuning, "set tuning switches by name; returns the record as it was");
  m.def("product_path", [](const std::string& format) { return product_path(format_named(format)); },
        "where a format's products run on this build and CPU, in the start-up log's words");
  m.def("bf16_native", &bf16_native, "bf16 pairs multiply in hardware here (AVX512-BF16 or AMX tiles)");
  m.def("team_chains_run", &team_chains_run, "EAGLE chains run in one parallel region since the module loaded");
  m.def("team_stacks_run", &team_stacks_run, "layer stacks run in one parallel region since the module loaded");
}
