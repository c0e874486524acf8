// The CPU kernels module: int8_linear.cpp, quantize.cpp and cpu_ops.cpp, built together by layers/cpu_kernels.py.
#include <torch/extension.h>

torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales,
                          const c10::optional<torch::Tensor>& bias, int64_t N, int64_t bits);
std::string isa();
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> quantize_groups(const torch::Tensor& weight);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor silu_and_mul(const torch::Tensor& x);
torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& kv_cache,
                                     const torch::Tensor& block_tables, const torch::Tensor& lens, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear, "y = x . W^T + bias, W packed in 8 or 5 bits with a scale per 32 weights",
        py::arg("x"), py::arg("w"), py::arg("scales"), py::arg("bias"), py::arg("n"), py::arg("bits") = 8);
  m.def("quantize_groups", &quantize_groups,
        "per group of 32: Q5_0's rule where exact, else Q8_0's -> (int8 values, float16 scales, q5, exact)");
  m.def("isa", &isa, "the instruction set int8_linear was built for");
  m.def("rms_norm", &rms_norm, "RMSNorm in float32, scaled in the input dtype");
  m.def("silu_and_mul", &silu_and_mul, "SiLU(x[..., :n]) * x[..., n:]");
  m.def("rotary", &rotary, "neox-layout RoPE of [T, heads, head_dim] rows into a new tensor");
  m.def("paged_decode_attention", &paged_decode_attention, "one query per sequence against its paged K/V");
}
