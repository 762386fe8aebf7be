// Launchers of the CUDA kernels behind fe_megatron.ops (ngram_ops_kernels.cu).  This header
// and the .cu file use only the CUDA runtime, so they compile with nvcc alone; the torch
// binding (ngram_ops_cuda.cpp) checks tensors and passes raw pointers and the stream.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fe_megatron {

// Element types of tables and gradients.
enum class FloatType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Sorted positions reduced by one thread block in the deterministic backward; equal to the
// C++ and Triton chunk so that every compiled backend sums duplicates in the same order.
constexpr int64_t kChunk = 32;
// Largest n-gram order the hash kernel accepts.
constexpr int64_t kMaxWindow = 16;

// out[t, b] = (XOR_k x_{t-k} * mult[b, k]) mod moduli[b] + offsets[b]  (Eq. 1, 6).
void launch_ngram_hash(const int64_t* token_ids, const int64_t* multipliers, const int64_t* moduli,
                       const int64_t* offsets, int64_t* out, int64_t batch, int64_t seq, int64_t branches,
                       int64_t window, int64_t pad_id, cudaStream_t stream);

// out[m, :] = weight[indices[m], :]; rows outside [0, rows) are written as zeros, never read.
void launch_gather_rows(const void* weight, const int64_t* indices, void* out, int64_t count, int64_t rows,
                        int64_t width, int64_t element_size, cudaStream_t stream);

// Deterministic: `sorted` and `perm` come from a stable sort of the indices; `first` and
// `last` are [ceil(count / kChunk), width] fp32 scratch.  out[r] += sum of r's gradients.
void launch_sorted_backward(const void* grad_rows, FloatType grad_type, const int64_t* sorted, const int64_t* perm,
                            void* out, FloatType out_type, float* first, float* last, int64_t count, int64_t width,
                            cudaStream_t stream);

// Atomic: out[indices[m]] += grad_rows[m], one atomic add per element.
void launch_atomic_backward(const void* grad_rows, FloatType grad_type, const int64_t* indices, void* out,
                            FloatType out_type, int64_t count, int64_t width, cudaStream_t stream);

}  // namespace fe_megatron
