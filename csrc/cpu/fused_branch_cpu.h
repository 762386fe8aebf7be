// The fused branch on the CPU: FactorEngram's basis-gated reconstruction (Eq. 7-9, gated_reconstruction_cpu.cpp)
// and a decoding step's addresses and refinement (Eq. 1 and 10, decoding_cpu.cpp), with the hash of one position
// that the decoding step shares with ngram_ops_cpu.cpp's ngram_hash. Semantics: fe_megatron/ops/reference.py.
#pragma once

// ATen only, not torch/extension.h: the Python binding is ngram_ops_cpu.cpp's, and its headers are slow to compile
#include <ATen/ATen.h>

#include <ATen/Parallel.h>

#include <vector>

// Largest n-gram order the hash kernels accept (the paper uses 3).
constexpr int64_t kMaxWindow = 16;

// Eq. 1 for one position: out[b] = (XOR_k recent[k] * m[b, k]) mod p_b + offset_b, recent[k] = x_{t-k}. The hash of
// ngram_hash (a whole batch) and of ngram_hash_decode_ (a decoding step), written once.
inline void hash_branches(const uint64_t* recent, const int64_t* mult, const int64_t* mod, const int64_t* off,
                          int64_t branches, int64_t window, int64_t* out) {
  for (int64_t b = 0; b < branches; ++b) {
    uint64_t mix = 0;  // unsigned: wraps like torch's int64 multiply, with no undefined behaviour
    for (int64_t k = 0; k < window; ++k) mix ^= recent[k] * static_cast<uint64_t>(mult[b * window + k]);
    int64_t r = static_cast<int64_t>(mix) % mod[b];
    if (r < 0) r += mod[b];  // torch.remainder: the sign of the divisor
    out[b] = r + off[b];
  }
}

// One thread for a problem too small to share: a decoding step's products of a few rows cost less than waking a
// second thread for each of them (a served step of 8 requests at the demo's width: 100 us on 2 threads, 50 on one).
// Restores the caller's thread count when it goes.
class SmallProblemThreads {
 public:
  explicit SmallProblemThreads(double multiply_adds) : previous_(at::get_num_threads()) {
    if (multiply_adds < kSmallProblem && previous_ > 1) at::set_num_threads(1);
  }
  ~SmallProblemThreads() {
    if (at::get_num_threads() != previous_) at::set_num_threads(previous_);
  }
  SmallProblemThreads(const SmallProblemThreads&) = delete;
  SmallProblemThreads& operator=(const SmallProblemThreads&) = delete;

 private:
  static constexpr double kSmallProblem = 4.0e6;  // multiply-adds
  int previous_;
};

// e = D^T (z * sigmoid(D q / sqrt(hidden_size))): coefficients [M, s], query [M, d_m], dictionary [s, d_m].
at::Tensor gated_reconstruction_forward(at::Tensor coefficients, at::Tensor query, at::Tensor dictionary,
                                           int64_t hidden_size);

// (dL/dz, dL/dq, dL/dD) from dL/de and the forward's inputs, the gate recomputed.
std::vector<at::Tensor> gated_reconstruction_backward(at::Tensor grad_memory, at::Tensor coefficients,
                                                         at::Tensor query, at::Tensor dictionary,
                                                         int64_t hidden_size);

// v = V D^T (z * sigmoid(D RMSNorm(Q^T h) / sqrt(hidden_size))), without autograd: hidden [N, d], coefficients
// [N, s], query_weight [d_m, d], norm_weight [d_m], dictionary [s, d_m], value_weight [out, d_m].
at::Tensor basis_memory_values(at::Tensor hidden, at::Tensor coefficients, at::Tensor query_weight,
                                  at::Tensor norm_weight, double eps, at::Tensor dictionary,
                                  at::Tensor value_weight, int64_t hidden_size);

// Eq. 1 at one new position per sequence: the row indices [R, branches] of ids [R] after each sequence's last
// max_order - 1 ids in id_state[slots[r], :] (int32 or int64, [slots, >= max_order - 1]), which advances in place.
at::Tensor ngram_hash_decode_(at::Tensor ids, at::Tensor id_state, at::Tensor slots,
                                 at::Tensor multipliers, at::Tensor moduli, at::Tensor offsets, int64_t pad_id);

// m = v + SiLU(sum_k w[:, k] * RMSNorm(v_{t-(K-1-k) r})) at one new position per sequence, the earlier values in
// state[slots[r], :(K-1) r], which advances in place: values [R, C], state [slots, >= (K-1) r, C].
at::Tensor short_conv_decode_(at::Tensor values, at::Tensor state, at::Tensor slots,
                                 at::Tensor norm_weight, at::Tensor conv_weight, int64_t dilation, double eps);
