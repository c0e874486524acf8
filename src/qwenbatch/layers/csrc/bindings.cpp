// The CPU kernels module: int8_linear.cpp, dequantize.cpp, quantize.cpp, cpu_ops.cpp, decode_attention.cpp,
// prefill_attention.cpp, prefill_attention_f32.cpp, decode_layer.cpp, host_allocator.cpp, sampling.cpp and
// logprobs.cpp, built together by layers/cpu_kernels.py.
#include "int8_tasks.h"
#include "ops.h"

#include <torch/csrc/utils/pybind.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The long calls release the GIL: a server's event loop shares the process with the engine's thread.
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("int8_linear", &int8_linear, "y = x . W^T + bias, W packed in 8 or 5 bits with a scale per 32 weights", no_gil,
        py::arg("x"), py::arg("w"), py::arg("scales"), py::arg("bias"), py::arg("n"), py::arg("bits") = 8,
        py::arg("silu_and_mul") = false);
  m.def("int8_dequantize", &int8_dequantize, "the bf16 W^T [K, N] that a packed int8_linear weight stands for", no_gil,
        py::arg("w"), py::arg("scales"), py::arg("n"), py::arg("k"), py::arg("bits") = 8,
        py::arg("gate_up_halves") = false);
  m.def("quantize_groups", &quantize_groups,
        "per group of 32: Q5_0's rule where exact, else Q8_0's -> (int8 values, float16 scales, q5, exact)");
  m.def("isa", &isa, "the instruction set int8_linear was built for");
  m.def(
      "int8_linear_tasks",
      [](int64_t m, int64_t n, int64_t k, int64_t threads) {
        const qb::Int8Tasks plan = qb::int8_tasks(m, k, n / qb::kTileRows, threads);
        return std::make_tuple(plan.tiles_per_task, plan.tile_runs, plan.rows_per_block, plan.row_blocks);
      },
      "how int8_linear cuts an [m, k] x [k, n] call into tasks for `threads` threads: (tiles_per_task, tile_runs, "
      "rows_per_block, row_blocks)",
      py::arg("m"), py::arg("n"), py::arg("k"), py::arg("threads"));
  m.def("rms_norm", &rms_norm, "RMSNorm in float32, scaled in the input dtype");
  m.def("add_rms_norm", &add_rms_norm, "residual += x in place, then RMSNorm(residual)");
  m.def("silu_and_mul", &silu_and_mul, "SiLU(x[..., :n]) * x[..., n:]");
  m.def("rotary", &rotary, "neox-layout RoPE of [T, heads, head_dim] rows into a new tensor");
  m.def("paged_decode_attention", &paged_decode_attention, "one query per sequence against its paged K/V", no_gil);
  m.def("decode_attention_isa", &decode_attention_isa, "what the bf16 decode attention takes its scores with");
  m.def("prefill_attention_isa", &prefill_attention_isa,
        "what prefill_attention takes its products with in a dtype (\"bfloat16\" or \"float32\"); \"\" where not built",
        py::arg("dtype"));
  m.def("prefill_attention", &prefill_attention,
        "bf16 or float32 queries of a chunk against its context (rows of k and v, or the cache rows slots pick), "
        "bottom-right causal, FlashAttention-tiled, into out where given",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"), py::arg("slots") = py::none(),
        py::arg("out") = py::none(), no_gil);
  m.def("greedy_tokens", &greedy_tokens, "each row's argmax and whether it holds an inf or a NaN, in one pass");
  m.def("mask_to_allowed", &mask_to_allowed, "logits -inf where a row's allowed-token bit is clear, and its flags");
  m.def("sample_tokens", &sample_tokens,
        "each row's token drawn from one uniform number after temperature, top-k, top-p and min-p (temperature 0: "
        "the argmax), after its penalties and suppressed ids",
        no_gil);
  m.def("token_logprobs", &token_logprobs,
        "each row's target token's log-probability and rank, and its k best logits as log-probabilities, with ids",
        no_gil);
  // module_local: the tests load builds for several targets into one process.
  py::class_<Int8Weight>(m, "Int8Weight", py::module_local(), "a linear layer's weights in int8_linear's packed format")
      .def(py::init<at::Tensor, at::Tensor, c10::optional<at::Tensor>, int64_t, int64_t, int64_t, bool>(),
           py::arg("packed"), py::arg("scales"), py::arg("bias"), py::arg("n"), py::arg("out_features"),
           py::arg("bits"), py::arg("silu_and_mul") = false);
  py::class_<LayerLinear>(m, "LayerLinear", py::module_local(),
                          "a decoder layer's linear for decode_layer: int8 or oneDNN-packed weights")
      .def(py::init<>())
      .def_readwrite("int8", &LayerLinear::int8)
      .def_readwrite("onednn_weight", &LayerLinear::onednn_weight)
      .def_readwrite("onednn_bias", &LayerLinear::onednn_bias);
  py::class_<DecodeLayerWeights>(m, "DecodeLayerWeights", py::module_local(),
                                 "one decoder layer with int8 or oneDNN-packed linears, for decode_layer")
      .def(py::init<>())
      .def_readwrite("input_norm", &DecodeLayerWeights::input_norm)
      .def_readwrite("post_attention_norm", &DecodeLayerWeights::post_attention_norm)
      .def_readwrite("q_norm", &DecodeLayerWeights::q_norm)
      .def_readwrite("k_norm", &DecodeLayerWeights::k_norm)
      .def_readwrite("qkv", &DecodeLayerWeights::qkv)
      .def_readwrite("o", &DecodeLayerWeights::o)
      .def_readwrite("gate_up", &DecodeLayerWeights::gate_up)
      .def_readwrite("down", &DecodeLayerWeights::down)
      .def_readwrite("heads", &DecodeLayerWeights::heads)
      .def_readwrite("kv_heads", &DecodeLayerWeights::kv_heads)
      .def_readwrite("head_dim", &DecodeLayerWeights::head_dim)
      .def_readwrite("eps", &DecodeLayerWeights::eps)
      .def_readwrite("scale", &DecodeLayerWeights::scale);
  m.def("decode_layer", &decode_layer, "one decoder layer of a step in which every row decodes", no_gil);
  m.def("decode_layers", &decode_layers, "every decoder layer of a step in which every row decodes, in turn", no_gil);
  m.def("install_step_buffer_allocator", &install_step_buffer_allocator,
        "make PyTorch's CPU allocator one that caches freed buffers of >= 32 MiB, up to this many bytes");
  m.def("empty_step_buffer_cache", &empty_step_buffer_cache, "unmap every cached buffer");
  m.def("step_buffer_stats", &step_buffer_stats, "(bytes of cached-allocator buffers in use, bytes cached)");
}
