// Torch binding of the CUDA kernels (ngram_ops_kernels.cu): checks tensors, allocates the
// outputs and scratch on the current stream, and hands raw pointers to the launchers.
#include <torch/extension.h>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "ngram_ops_kernels.h"

namespace {

using fe_megatron::FloatType;

void check_cuda(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "fe_megatron cuda: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), "fe_megatron cuda: ", name, " must be contiguous");
}

void check_long(const torch::Tensor& t, const char* name) {
  check_cuda(t, name);
  TORCH_CHECK(t.scalar_type() == torch::kInt64, "fe_megatron cuda: ", name, " must be int64, got ", t.scalar_type());
}

FloatType float_type(const torch::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case torch::kFloat32: return FloatType::kFloat32;
    case torch::kBFloat16: return FloatType::kBFloat16;
    case torch::kFloat16: return FloatType::kFloat16;
    default:
      TORCH_CHECK(false, "fe_megatron cuda: ", name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

torch::Tensor ngram_hash(torch::Tensor token_ids, torch::Tensor multipliers, torch::Tensor moduli,
                         torch::Tensor offsets, int64_t pad_id) {
  check_long(token_ids, "token_ids");
  check_long(multipliers, "multipliers");
  check_long(moduli, "moduli");
  check_long(offsets, "offsets");
  TORCH_CHECK(multipliers.size(1) <= fe_megatron::kMaxWindow, "ngram_hash: n-gram window ", multipliers.size(1),
              " exceeds the supported ", fe_megatron::kMaxWindow);
  const c10::cuda::CUDAGuard guard(token_ids.device());
  auto out = torch::empty({token_ids.size(0), token_ids.size(1), multipliers.size(0)}, token_ids.options());
  fe_megatron::launch_ngram_hash(token_ids.data_ptr<int64_t>(), multipliers.data_ptr<int64_t>(),
                                 moduli.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), out.data_ptr<int64_t>(),
                                 token_ids.size(0), token_ids.size(1), multipliers.size(0), multipliers.size(1), pad_id,
                                 c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

torch::Tensor gather_rows_forward(torch::Tensor weight, torch::Tensor flat_indices) {
  check_cuda(weight, "weight");
  check_long(flat_indices, "flat_indices");
  float_type(weight, "weight");
  TORCH_CHECK(weight.dim() == 2, "fe_megatron cuda: weight must be [rows, width]");
  const c10::cuda::CUDAGuard guard(weight.device());
  auto out = torch::empty({flat_indices.numel(), weight.size(1)}, weight.options());
  fe_megatron::launch_gather_rows(weight.data_ptr(), flat_indices.data_ptr<int64_t>(), out.data_ptr(),
                                  flat_indices.numel(), weight.size(0), weight.size(1), weight.element_size(),
                                  c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

void gather_rows_backward(torch::Tensor grad_rows, torch::Tensor flat_indices, torch::Tensor out,
                          bool deterministic) {
  check_cuda(grad_rows, "grad_rows");
  check_cuda(out, "out");
  check_long(flat_indices, "flat_indices");
  TORCH_CHECK(out.dim() == 2 && grad_rows.dim() == 2 && grad_rows.size(1) == out.size(1) &&
                  grad_rows.size(0) == flat_indices.numel(),
              "fe_megatron cuda: gather_rows_backward expects grad_rows [M, w], flat_indices [M], out [rows, w]");
  const c10::cuda::CUDAGuard guard(out.device());
  const int64_t count = flat_indices.numel(), width = out.size(1);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  // atomic adds only into fp32: into bf16 or fp16 each duplicate's add would round, so those sum
  // every row's duplicates in fp32 first (the sorted reduction) and round once
  if (!deterministic && out.scalar_type() == torch::kFloat32) {
    fe_megatron::launch_atomic_backward(grad_rows.data_ptr(), float_type(grad_rows, "grad_rows"),
                                        flat_indices.data_ptr<int64_t>(), out.data_ptr(), float_type(out, "out"), count,
                                        width, stream);
  } else {
    const auto sorted_and_perm = flat_indices.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false);
    const auto& sorted = std::get<0>(sorted_and_perm);
    const auto& perm = std::get<1>(sorted_and_perm);
    const int64_t chunks = (count + fe_megatron::kChunk - 1) / fe_megatron::kChunk;
    auto first = torch::empty({chunks, width}, out.options().dtype(torch::kFloat32));
    auto last = torch::empty_like(first);
    fe_megatron::launch_sorted_backward(grad_rows.data_ptr(), float_type(grad_rows, "grad_rows"),
                                        sorted.data_ptr<int64_t>(), perm.data_ptr<int64_t>(), out.data_ptr(),
                                        float_type(out, "out"), first.data_ptr<float>(), last.data_ptr<float>(), count,
                                        width, stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fe_megatron CUDA kernels: n-gram hash, row gather, deduplicated table backward";
  m.attr("CHUNK") = fe_megatron::kChunk;
  m.def("ngram_hash", &ngram_hash, "multi-head n-gram hash of all branches (Eq. 1, 6)");
  m.def("gather_rows_forward", &gather_rows_forward, "weight[flat_indices]");
  m.def("gather_rows_backward", &gather_rows_backward, "out[i] += deduplicated row gradients");
}
