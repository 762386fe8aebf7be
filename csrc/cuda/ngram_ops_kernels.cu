// CUDA kernels behind fe_megatron.ops.  Semantics: fe_megatron/ops/reference.py; design and
// byte counts: docs/kernels.md.  All offsets are int64, so tables may exceed 2^31 elements.
#include "ngram_ops_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

namespace fe_megatron {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

int blocks_for(int64_t work, int threads) {
  return static_cast<int>(std::min<int64_t>((work + threads - 1) / threads, 1 << 20));
}

// One thread per (token, branch) output; the K window tokens of a token are read by its
// nb branch threads from L1.
__global__ void ngram_hash_kernel(const int64_t* __restrict__ ids, const int64_t* __restrict__ mult,
                                  const int64_t* __restrict__ mod, const int64_t* __restrict__ off,
                                  int64_t* __restrict__ out, int64_t total, int64_t seq, int64_t branches,
                                  int64_t window, int64_t pad_id) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t token = e / branches, b = e - token * branches, t = token % seq;
    uint64_t mix = 0;  // unsigned: wraps like torch's int64 multiply, with no undefined behaviour
    for (int64_t k = 0; k < window; ++k) {
      const uint64_t x = static_cast<uint64_t>(t >= k ? ids[token - k] : pad_id);
      mix ^= x * static_cast<uint64_t>(mult[b * window + k]);
    }
    int64_t r = static_cast<int64_t>(mix) % mod[b];
    if (r < 0) r += mod[b];
    out[e] = r + off[b];
  }
}

// Row copy in `Unit`-sized pieces (16 bytes when rows allow it): consecutive threads copy
// consecutive pieces of a row, so both the read and the write are coalesced.
template <typename Unit>
__global__ void gather_rows_kernel(const Unit* __restrict__ weight, const int64_t* __restrict__ idx,
                                   Unit* __restrict__ out, int64_t count, int64_t rows, int64_t units_per_row) {
  const int64_t total = count * units_per_row;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t m = e / units_per_row, u = e - m * units_per_row;
    const int64_t r = __ldg(idx + m);
    Unit value{};
    if (r >= 0 && r < rows) value = weight[r * units_per_row + u];
    out[e] = value;
  }
}

// Pass 1 (one block per chunk of sorted positions, one thread per column): whole runs of
// equal rows are added to `out`; a leading continuation is parked in first[c], a trailing
// run that goes on past the chunk in last[c].
template <typename G, typename O>
__global__ void reduce_chunks_kernel(const G* __restrict__ grad, const int64_t* __restrict__ sorted,
                                     const int64_t* __restrict__ perm, O* __restrict__ out, float* __restrict__ first,
                                     float* __restrict__ last, int64_t count, int64_t width) {
  const int64_t chunk = blockIdx.x;
  const int64_t col = blockIdx.y * int64_t(blockDim.x) + threadIdx.x;
  if (col >= width) return;
  const int64_t lo = chunk * kChunk, hi = min(lo + kChunk, count);
  float acc = 0.f;
  int64_t start = lo;
  for (int64_t i = lo; i < hi; ++i) {
    const int64_t row = sorted[i];
    acc += to_float(grad[perm[i] * width + col]);
    const int64_t next = i + 1 < count ? sorted[i + 1] : -1;
    if (i + 1 < hi && next == row) continue;
    const bool starts_here = start == 0 || sorted[start - 1] != row;
    const bool ends_here = next != row;
    if (starts_here && ends_here) {
      O* dst = out + row * width + col;
      *dst = from_float<O>(to_float(*dst) + acc);
    } else {
      (starts_here ? last : first)[chunk * width + col] = acc;
    }
    acc = 0.f;
    start = i + 1;
  }
}

// Pass 2: the chunk holding the head of a run that crosses chunks adds, in chunk order,
// its last[c] and the following chunks' first[k] to `out`.
template <typename O>
__global__ void finish_runs_kernel(const int64_t* __restrict__ sorted, O* __restrict__ out,
                                   const float* __restrict__ first, const float* __restrict__ last, int64_t count,
                                   int64_t width, int64_t chunks) {
  const int64_t chunk = blockIdx.x;
  const int64_t col = blockIdx.y * int64_t(blockDim.x) + threadIdx.x;
  if (col >= width) return;
  const int64_t lo = chunk * kChunk, e = min(lo + kChunk, count) - 1;
  const int64_t row = sorted[e];
  const bool continues = e + 1 < count && sorted[e + 1] == row;
  const bool head_here = lo == 0 || sorted[lo - 1] != row;
  if (!continues || !head_here) return;
  float total = last[chunk * width + col];
  for (int64_t k = chunk + 1; k < chunks && sorted[k * kChunk] == row; ++k) {
    total += first[k * width + col];
    const int64_t ek = min((k + 1) * kChunk, count) - 1;
    if (sorted[ek] != row || ek + 1 == count || sorted[ek + 1] != row) break;
  }
  O* dst = out + row * width + col;
  *dst = from_float<O>(to_float(*dst) + total);
}

__device__ __forceinline__ void atomic_add(float* p, float v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add(__nv_bfloat16* p, float v) { atomicAdd(p, __float2bfloat16_rn(v)); }
__device__ __forceinline__ void atomic_add(__half* p, float v) { atomicAdd(p, __float2half_rn(v)); }

template <typename G, typename O>
__global__ void atomic_backward_kernel(const G* __restrict__ grad, const int64_t* __restrict__ idx, O* __restrict__ out,
                                       int64_t count, int64_t width) {
  const int64_t total = count * width;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t m = e / width, c = e - m * width;
    atomic_add(out + idx[m] * width + c, to_float(grad[e]));
  }
}

// Calls fn(G{}, O{}) with the C++ types named by the two enums.
template <typename Fn>
void dispatch_types(FloatType grad_type, FloatType out_type, Fn fn) {
  auto with_out = [&](auto g) {
    switch (out_type) {
      case FloatType::kFloat32: fn(g, float{}); break;
      case FloatType::kBFloat16: fn(g, __nv_bfloat16{}); break;
      case FloatType::kFloat16: fn(g, __half{}); break;
    }
  };
  switch (grad_type) {
    case FloatType::kFloat32: with_out(float{}); break;
    case FloatType::kBFloat16: with_out(__nv_bfloat16{}); break;
    case FloatType::kFloat16: with_out(__half{}); break;
  }
}

}  // namespace

void launch_ngram_hash(const int64_t* token_ids, const int64_t* multipliers, const int64_t* moduli,
                       const int64_t* offsets, int64_t* out, int64_t batch, int64_t seq, int64_t branches,
                       int64_t window, int64_t pad_id, cudaStream_t stream) {
  const int64_t total = batch * seq * branches;
  if (total == 0) return;
  ngram_hash_kernel<<<blocks_for(total, kThreads), kThreads, 0, stream>>>(token_ids, multipliers, moduli, offsets, out,
                                                                         total, seq, branches, window, pad_id);
}

void launch_gather_rows(const void* weight, const int64_t* indices, void* out, int64_t count, int64_t rows,
                        int64_t width, int64_t element_size, cudaStream_t stream) {
  if (count == 0) return;
  const int64_t row_bytes = width * element_size;
  const auto aligned = [&](int64_t unit) {
    return row_bytes % unit == 0 && reinterpret_cast<uintptr_t>(weight) % unit == 0 &&
           reinterpret_cast<uintptr_t>(out) % unit == 0;
  };
  const auto launch = [&](auto unit) {
    using Unit = decltype(unit);
    const int64_t units = row_bytes / int64_t(sizeof(Unit));
    gather_rows_kernel<Unit><<<blocks_for(count * units, kThreads), kThreads, 0, stream>>>(
        static_cast<const Unit*>(weight), indices, static_cast<Unit*>(out), count, rows, units);
  };
  if (aligned(16)) launch(uint4{});
  else if (aligned(8)) launch(uint2{});
  else if (aligned(4)) launch(uint32_t{});
  else launch(uint16_t{});
}

void launch_sorted_backward(const void* grad_rows, FloatType grad_type, const int64_t* sorted, const int64_t* perm,
                            void* out, FloatType out_type, float* first, float* last, int64_t count, int64_t width,
                            cudaStream_t stream) {
  if (count == 0) return;
  const int64_t chunks = (count + kChunk - 1) / kChunk;
  const int threads = static_cast<int>(std::min<int64_t>(kThreads, (width + 31) / 32 * 32));
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>((width + threads - 1) / threads));
  dispatch_types(grad_type, out_type, [&](auto g, auto o) {
    using G = decltype(g);
    using O = decltype(o);
    reduce_chunks_kernel<G, O><<<grid, threads, 0, stream>>>(static_cast<const G*>(grad_rows), sorted, perm,
                                                            static_cast<O*>(out), first, last, count, width);
    finish_runs_kernel<O><<<grid, threads, 0, stream>>>(sorted, static_cast<O*>(out), first, last, count, width,
                                                        chunks);
  });
}

void launch_atomic_backward(const void* grad_rows, FloatType grad_type, const int64_t* indices, void* out,
                            FloatType out_type, int64_t count, int64_t width, cudaStream_t stream) {
  if (count == 0) return;
  dispatch_types(grad_type, out_type, [&](auto g, auto o) {
    using G = decltype(g);
    using O = decltype(o);
    atomic_backward_kernel<G, O><<<blocks_for(count * width, kThreads), kThreads, 0, stream>>>(
        static_cast<const G*>(grad_rows), indices, static_cast<O*>(out), count, width);
  });
}

}  // namespace fe_megatron
