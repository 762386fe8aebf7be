// A decoding step of FactorEngram's branch on the CPU, for sequences of one new position each (generate's steps, a
// server's steps of plain decodes): the addresses of the new ids (Eq. 1) after each sequence's last max_order - 1
// ids, and the causal refinement m = v + SiLU(Conv1D(RMSNorm(v_{<=t}))) (Eq. 10) after its last (K-1) r values. Each
// reads its look-back from a state cache and advances it by one position, in one pass per sequence: the torch
// composition gathers the look-back, joins it to the new position, computes every position of the window and
// writes the state back (eight operations or more for a few hundred numbers). Semantics:
// fe_megatron/ops/reference.py (ngram_hash_decode_, short_conv_decode_); design: docs/kernels.md, "The fused branch".
#include "fused_branch_cpu.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace {

// Sequences one task handles: a step of a few dozen runs in the calling thread.
constexpr int64_t kRequestGrain = 64;

void check_slots(const at::Tensor& slots, int64_t requests, int64_t capacity, const char* op) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.device().is_cpu() &&
                  slots.dim() == 1 && slots.size(0) == requests,
              op, " (cpp): slots must be contiguous int64 [", requests, "] on the CPU, got ", slots.scalar_type(), " ",
              slots.sizes());
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < requests; ++r) {
    TORCH_CHECK(slot[r] >= 0 && slot[r] < capacity, op, " (cpp): slot ", slot[r], " of request ", r,
                " is outside the state's ", capacity, " slots");
  }
}

template <typename I>
void hash_decode(const int64_t* ids, I* state, const int64_t* slots, const int64_t* mult, const int64_t* mod,
                 const int64_t* off, int64_t* out, int64_t requests, int64_t branches, int64_t window, int64_t history,
                 int64_t slot_stride, int64_t position_stride) {
  at::parallel_for(0, requests, kRequestGrain, [&](int64_t begin, int64_t end) {
    uint64_t recent[kMaxWindow];
    for (int64_t r = begin; r < end; ++r) {
      I* look_back = state + slots[r] * slot_stride;
      for (int64_t k = 0; k < window; ++k) {  // x_{t-k}: the new id, then the look-back from its end
        recent[k] = static_cast<uint64_t>(k == 0 ? ids[r] : static_cast<int64_t>(look_back[(history - k) *
                                                                                             position_stride]));
      }
      hash_branches(recent, mult, mod, off, branches, window, out + r * branches);
      for (int64_t place = 0; place + 1 < history; ++place) look_back[place * position_stride] =
          look_back[(place + 1) * position_stride];
      if (history > 0) look_back[(history - 1) * position_stride] = static_cast<I>(ids[r]);
    }
  });
}

template <typename T>
void decode(const T* values, T* state, const int64_t* slots, const T* norm_weight, const T* conv_weight, T* out,
            int64_t requests, int64_t channels, int64_t kernel, int64_t dilation, int64_t history, int64_t slot_stride,
            int64_t position_stride, float eps) {
  at::parallel_for(0, requests, kRequestGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(channels);
    for (int64_t r = begin; r < end; ++r) {
      T* look_back = state + slots[r] * slot_stride;
      const T* value = values + r * channels;
      std::fill(sums.begin(), sums.end(), 0.0f);
      for (int64_t k = 0; k < kernel; ++k) {  // taps t-(K-1)r, .., t: window position k r of the h + 1
        const int64_t place = k * dilation;
        const T* tap = place < history ? look_back + place * position_stride : value;
        float squares = 0.0f;
        for (int64_t c = 0; c < channels; ++c) squares += static_cast<float>(tap[c]) * static_cast<float>(tap[c]);
        const float scale = 1.0f / std::sqrt(squares / static_cast<float>(channels) + eps);
        for (int64_t c = 0; c < channels; ++c) {
          // as the composition rounds: the normed tap, then its product with the tap's weight, in T
          const float normed = static_cast<float>(static_cast<T>(static_cast<float>(tap[c]) * scale *
                                                              static_cast<float>(norm_weight[c])));
          sums[c] += static_cast<float>(static_cast<T>(normed * static_cast<float>(conv_weight[c * kernel + k])));
        }
      }
      for (int64_t c = 0; c < channels; ++c) {
        const float x = static_cast<float>(static_cast<T>(sums[c]));
        const float silu = static_cast<float>(static_cast<T>(x / (1.0f + std::exp(-x))));
        out[r * channels + c] = static_cast<T>(static_cast<float>(value[c]) + silu);
      }
      for (int64_t place = 0; place < history; ++place) {  // the look-back advances: its last h values
        const T* next = place + 1 < history ? look_back + (place + 1) * position_stride : value;
        std::copy(next, next + channels, look_back + place * position_stride);
      }
    }
  });
}

}  // namespace

at::Tensor short_conv_decode_(at::Tensor values, at::Tensor state, at::Tensor slots,
                                 at::Tensor norm_weight, at::Tensor conv_weight, int64_t dilation, double eps) {
  const auto type = values.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kBFloat16, "short_conv_decode_ (cpp): fp32 or bf16 values, "
              "got ", type);
  TORCH_CHECK(values.dim() == 2 && state.dim() == 3 && conv_weight.dim() == 2 && norm_weight.dim() == 1 &&
                  state.size(2) == values.size(1) && conv_weight.size(0) == values.size(1) &&
                  norm_weight.size(0) == values.size(1) && slots.dim() == 1 && slots.size(0) == values.size(0),
              "short_conv_decode_ (cpp): values [R, C], state [slots, positions, C], slots [R], norm_weight [C] and "
              "conv_weight [C, K], got ", values.sizes(), ", ", state.sizes(), ", ", slots.sizes(), ", ",
              norm_weight.sizes(), " and ", conv_weight.sizes());
  const int64_t kernel = conv_weight.size(1), history = (kernel - 1) * dilation;
  TORCH_CHECK(dilation >= 1 && state.size(1) >= history, "short_conv_decode_ (cpp): a state of ", state.size(1),
              " positions for a look-back of (K - 1) r = ", history, " (K = ", kernel, ", r = ", dilation, ")");
  for (const auto* tensor : {&values, &state, &norm_weight, &conv_weight}) {
    TORCH_CHECK(tensor->scalar_type() == type && tensor->device().is_cpu(), "short_conv_decode_ (cpp): CPU operands "
                "of one dtype (", type, ")");
  }
  TORCH_CHECK(values.is_contiguous() && norm_weight.is_contiguous() && conv_weight.is_contiguous() &&
                  state.stride(2) == 1,
              "short_conv_decode_ (cpp): contiguous values and weights, and a state whose channels are contiguous");
  check_slots(slots, values.size(0), state.size(0), "short_conv_decode_");
  const int64_t* slot = slots.data_ptr<int64_t>();
  auto out = at::empty_like(values);
  const auto run = [&](auto tag) {
    using T = decltype(tag);
    decode(values.data_ptr<T>(), state.data_ptr<T>(), slot, norm_weight.data_ptr<T>(), conv_weight.data_ptr<T>(),
           out.data_ptr<T>(), values.size(0), values.size(1), kernel, dilation, history, state.stride(0),
           state.stride(1), static_cast<float>(eps));
  };
  if (type == at::kFloat) {
    run(float{});
  } else {
    run(at::BFloat16{});
  }
  return out;
}

at::Tensor ngram_hash_decode_(at::Tensor ids, at::Tensor id_state, at::Tensor slots,
                                 at::Tensor multipliers, at::Tensor moduli, at::Tensor offsets,
                                 int64_t pad_id) {
  (void)pad_id;  // every sequence here continues: its look-back holds ids, never the padding before a start
  for (const auto* tensor : {&ids, &multipliers, &moduli, &offsets}) {
    TORCH_CHECK(tensor->scalar_type() == at::kLong && tensor->is_contiguous() && tensor->device().is_cpu(),
                "ngram_hash_decode_ (cpp): contiguous int64 CPU ids, multipliers, moduli and offsets");
  }
  const auto state_type = id_state.scalar_type();
  TORCH_CHECK((state_type == at::kLong || state_type == at::kInt) && id_state.dim() == 2 &&
                  id_state.device().is_cpu(),
              "ngram_hash_decode_ (cpp): an int32 or int64 CPU state [slots, positions], got ", state_type, " ",
              id_state.sizes());
  const int64_t branches = multipliers.size(0), window = multipliers.size(1), history = window - 1;
  TORCH_CHECK(ids.dim() == 1 && multipliers.dim() == 2 && moduli.sizes() == offsets.sizes() && moduli.dim() == 1 &&
                  moduli.size(0) == branches && window >= 1 && window <= kMaxWindow,
              "ngram_hash_decode_ (cpp): ids [R], multipliers [branches, K <= ", kMaxWindow, "], moduli and offsets "
              "[branches], got ", ids.sizes(), ", ", multipliers.sizes(), ", ", moduli.sizes(), " and ",
              offsets.sizes());
  TORCH_CHECK(id_state.size(1) >= history, "ngram_hash_decode_ (cpp): a state of ", id_state.size(1),
              " positions for a look-back of max_order - 1 = ", history);
  check_slots(slots, ids.size(0), id_state.size(0), "ngram_hash_decode_");
  auto out = at::empty({ids.size(0), branches}, ids.options());
  const auto run = [&](auto tag) {
    using I = decltype(tag);
    hash_decode(ids.data_ptr<int64_t>(), id_state.data_ptr<I>(), slots.data_ptr<int64_t>(),
                multipliers.data_ptr<int64_t>(), moduli.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(),
                out.data_ptr<int64_t>(), ids.size(0), branches, window, history, id_state.stride(0),
                id_state.stride(1));
  };
  if (state_type == at::kLong) {
    run(int64_t{});
  } else {
    run(int32_t{});
  }
  return out;
}
