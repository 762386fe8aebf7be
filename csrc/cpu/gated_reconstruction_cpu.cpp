// CPU kernels of FactorEngram's basis-gated reconstruction (Eq. 7-9), e = D^T (z * sigmoid(D q / sqrt(d))),
// forward and backward.  Semantics: fe_megatron/ops/reference.py (gated_reconstruction_forward/_backward);
// design: docs/kernels.md, "The fused branch".
//
// The two products with the dictionary are GEMMs through ATen (its BLAS: MKL or OpenBLAS, multi-threaded); what
// lies between them, the gate and the product with the coefficients, is one pass over the [M, s] logits in place,
// instead of the unfused branch's division, sigmoid and product (three passes, three [M, s] tensors).  The
// backward recomputes the logits from the saved query, so the forward keeps no [M, s] tensor for it: autograd
// saves the coefficients, the query and the dictionary only.
#include "fused_branch_cpu.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// Elements of the logits one task of the gate's pass handles.
constexpr int64_t kGrain = 1 << 14;

// exp(x) for float x, within a few ulp of expf (the gate then meets the kernels' fp32 bound, 1e-5 of the largest
// value, with room), written so that the compiler can vectorize the loops that call it (no branch, no call):
// Cephes' expf, range-reduced by ln 2, a degree-5 polynomial, and the power of two built in the exponent's bits.
// expf itself is a library call that GCC does not vectorize without -ffast-math, which would change the rest of
// the file's arithmetic. Past the clamp the result is 2^-126 or +inf, where the sigmoid is 1 or 0 to fp32.
inline float fast_exp(float x) {
  x = x < -87.33654f ? -87.33654f : (x > 88.72283f ? 88.72283f : x);  // a NaN stays a NaN
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer
  const float n = (x * 1.44269504088896341f + kRound) - kRound;  // round(x / ln 2)
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;  // x - n ln 2, in two parts (Cody-Waite)
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float poly = p * r * r + r + 1.0f;
  int32_t bits = static_cast<int32_t>(n) + 127;
  bits = bits < 1 ? 1 : bits;  // exp(-87.3) is the smallest normal: 2^-126
  bits <<= 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return poly * scale;
}

inline float sigmoid(float x) { return 1.0f / (1.0f + fast_exp(-x)); }

void check_operands(const at::Tensor& coefficients, const at::Tensor& query, const at::Tensor& dictionary) {
  const auto type = coefficients.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kBFloat16, "gated_reconstruction (cpp): fp32 or bf16 "
              "operands, got ", type);
  TORCH_CHECK(query.scalar_type() == type && dictionary.scalar_type() == type, "gated_reconstruction (cpp): the "
              "coefficients, query and dictionary share a dtype, got ", type, ", ", query.scalar_type(), " and ",
              dictionary.scalar_type());
  TORCH_CHECK(coefficients.dim() == 2 && query.dim() == 2 && dictionary.dim() == 2 &&
                  coefficients.size(0) == query.size(0) && coefficients.size(1) == dictionary.size(0) &&
                  query.size(1) == dictionary.size(1),
              "gated_reconstruction (cpp): coefficients [M, s], query [M, d_m] and dictionary [s, d_m], got ",
              coefficients.sizes(), ", ", query.sizes(), " and ", dictionary.sizes());
  for (const auto* tensor : {&coefficients, &query, &dictionary}) {
    TORCH_CHECK(tensor->device().is_cpu() && tensor->is_contiguous(), "gated_reconstruction (cpp): contiguous CPU "
                "tensors");
  }
}

// logits <- sigmoid(logits / divisor) * coefficients, in place (Eq. 7, then Eq. 8's product).
template <typename T>
void gate_coefficients_(T* logits, const T* coefficients, int64_t count, float divisor) {
  at::parallel_for(0, count, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float alpha = sigmoid(static_cast<float>(logits[i]) / divisor);
      logits[i] = static_cast<T>(static_cast<float>(coefficients[i]) * alpha);
    }
  });
}

// From the logits g and G = dL/du (u = z * alpha), in place: logits <- dL/dg, grad_gated <- u; grad_z <- dL/dz.
template <typename T>
void gate_backward_(T* logits, T* grad_gated, const T* coefficients, T* grad_coefficients, int64_t count,
                    float divisor) {
  at::parallel_for(0, count, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float alpha = sigmoid(static_cast<float>(logits[i]) / divisor);
      const float z = static_cast<float>(coefficients[i]), grad = static_cast<float>(grad_gated[i]);
      grad_coefficients[i] = static_cast<T>(grad * alpha);
      logits[i] = static_cast<T>(grad * z * alpha * (1.0f - alpha) / divisor);
      grad_gated[i] = static_cast<T>(z * alpha);
    }
  });
}

float gate_divisor(int64_t hidden_size) {
  TORCH_CHECK(hidden_size > 0, "gated_reconstruction: hidden_size must be positive, got ", hidden_size);
  return static_cast<float>(std::sqrt(static_cast<double>(hidden_size)));  // as torch divides by a Python float
}

}  // namespace

at::Tensor gated_reconstruction_forward(at::Tensor coefficients, at::Tensor query, at::Tensor dictionary,
                                           int64_t hidden_size) {
  check_operands(coefficients, query, dictionary);
  const float divisor = gate_divisor(hidden_size);
  SmallProblemThreads threads(2.0 * coefficients.numel() * query.size(1));
  auto gated = at::mm(query, dictionary.t());  // the gate's logits D q, [M, s] (Eq. 7)
  if (coefficients.scalar_type() == at::kFloat) {
    gate_coefficients_(gated.data_ptr<float>(), coefficients.data_ptr<float>(), gated.numel(), divisor);
  } else {
    gate_coefficients_(gated.data_ptr<at::BFloat16>(), coefficients.data_ptr<at::BFloat16>(), gated.numel(),
                       divisor);
  }
  return at::mm(gated, dictionary);  // e = D^T (z * alpha), [M, d_m] (Eq. 9)
}

std::vector<at::Tensor> gated_reconstruction_backward(at::Tensor grad_memory, at::Tensor coefficients,
                                                         at::Tensor query, at::Tensor dictionary,
                                                         int64_t hidden_size) {
  check_operands(coefficients, query, dictionary);
  TORCH_CHECK(grad_memory.sizes() == query.sizes() && grad_memory.scalar_type() == query.scalar_type() &&
                  grad_memory.is_contiguous(),
              "gated_reconstruction_backward (cpp): a contiguous gradient of the output's shape ", query.sizes(),
              " and dtype ", query.scalar_type(), ", got ", grad_memory.sizes(), " ", grad_memory.scalar_type());
  const float divisor = gate_divisor(hidden_size);
  auto logits = at::mm(query, dictionary.t());            // recomputed: [M, s]
  auto grad_gated = at::mm(grad_memory, dictionary.t());  // dL/du, [M, s]
  auto grad_coefficients = at::empty_like(coefficients);
  if (coefficients.scalar_type() == at::kFloat) {
    gate_backward_(logits.data_ptr<float>(), grad_gated.data_ptr<float>(), coefficients.data_ptr<float>(),
                   grad_coefficients.data_ptr<float>(), logits.numel(), divisor);
  } else {
    gate_backward_(logits.data_ptr<at::BFloat16>(), grad_gated.data_ptr<at::BFloat16>(),
                   coefficients.data_ptr<at::BFloat16>(), grad_coefficients.data_ptr<at::BFloat16>(), logits.numel(),
                   divisor);
  }
  // logits now hold dL/dg, grad_gated holds u = z * alpha
  auto grad_query = at::mm(logits, dictionary);
  auto grad_dictionary = at::mm(logits.t(), query);
  grad_dictionary.addmm_(grad_gated.t(), grad_memory);
  return {grad_coefficients, grad_query, grad_dictionary};
}

at::Tensor basis_memory_values(at::Tensor hidden, at::Tensor coefficients, at::Tensor query_weight,
                                  at::Tensor norm_weight, double eps, at::Tensor dictionary,
                                  at::Tensor value_weight, int64_t hidden_size) {
  TORCH_CHECK(hidden.dim() == 2 && query_weight.dim() == 2 && value_weight.dim() == 2 && norm_weight.dim() == 1 &&
                  hidden.size(0) == coefficients.size(0) && hidden.size(1) == query_weight.size(1) &&
                  query_weight.size(0) == dictionary.size(1) && norm_weight.size(0) == dictionary.size(1) &&
                  value_weight.size(1) == dictionary.size(1),
              "basis_memory_values (cpp): hidden [N, d], query_weight [d_m, d], norm_weight [d_m] and value_weight "
              "[out, d_m] for a dictionary [s, d_m], got ", hidden.sizes(), ", ", query_weight.sizes(), ", ",
              norm_weight.sizes(), " and ", value_weight.sizes(), " for ", dictionary.sizes());
  for (const auto* tensor : {&hidden, &query_weight, &norm_weight, &value_weight}) {
    TORCH_CHECK(tensor->scalar_type() == coefficients.scalar_type() && tensor->device().is_cpu() &&
                    tensor->is_contiguous(),
                "basis_memory_values (cpp): contiguous CPU operands of one dtype (", coefficients.scalar_type(), ")");
  }
  // Q^T h and its RMSNorm by the same ATen functions as the branch's modules (nn.Linear, nn.RMSNorm), and the
  // gated reconstruction by the kernel its operator runs: bit for bit what the modules give, so that a forward
  // without gradients (a reentrant activation checkpoint's first pass) equals the one with them
  SmallProblemThreads threads(static_cast<double>(hidden.size(0)) *
                              (query_weight.numel() + 2.0 * dictionary.numel() + value_weight.numel()));
  auto query = at::rms_norm(at::linear(hidden, query_weight), {query_weight.size(0)}, norm_weight, eps);
  return at::linear(gated_reconstruction_forward(coefficients, query.contiguous(), dictionary, hidden_size),
                    value_weight);
}
