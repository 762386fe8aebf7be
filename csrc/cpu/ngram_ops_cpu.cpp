// CPU (OpenMP) kernels behind fe_megatron.ops: the multi-head n-gram hash, the row gather,
// the deduplicated table backward and the table optimizer's fused update.  Semantics: fe_megatron/ops/reference.py; design:
// docs/kernels.md.  The backward into fp32 partitions rows over threads (bit-identical to
// the reference); into bf16/fp16 it is the chunked, sorted reduction of the CUDA and
// Triton kernels.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "fused_branch_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace {

// Positions of the sorted index array reduced by one task; also the CUDA/Triton chunk.
constexpr int64_t kChunk = 32;
// Gathered rows ahead of the current one whose first cache line is prefetched.
constexpr int64_t kPrefetchDistance = 8;

void check_float(const torch::Tensor& t, const char* name) {
  const auto type = t.scalar_type();
  TORCH_CHECK(type == torch::kFloat32 || type == torch::kBFloat16 || type == torch::kFloat16, "fe_megatron cpp: ", name,
              " must be float32, bfloat16 or float16 (fp32 accumulation), got ", type);
}

void check_long(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kInt64, "fe_megatron cpp: ", name, " must be int64, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "fe_megatron cpp: ", name, " must be contiguous");
  TORCH_CHECK(t.device().is_cpu(), "fe_megatron cpp: ", name, " must be a CPU tensor");
}

// index[t, b] = (XOR_k x_{t-k} * m[b, k]) mod p_b + offset_b, x_{t-k} = pad before the start (Eq. 1, 6).
torch::Tensor ngram_hash(torch::Tensor token_ids, torch::Tensor multipliers, torch::Tensor moduli,
                         torch::Tensor offsets, int64_t pad_id) {
  check_long(token_ids, "token_ids");
  check_long(multipliers, "multipliers");
  check_long(moduli, "moduli");
  check_long(offsets, "offsets");
  const int64_t batch = token_ids.size(0), seq = token_ids.size(1);
  const int64_t branches = multipliers.size(0), window = multipliers.size(1);
  TORCH_CHECK(window <= kMaxWindow, "ngram_hash: n-gram window ", window, " exceeds the supported ", kMaxWindow);
  auto out = torch::empty({batch, seq, branches}, token_ids.options());
  const int64_t* ids = token_ids.data_ptr<int64_t>();
  const int64_t* mult = multipliers.data_ptr<int64_t>();
  const int64_t* mod = moduli.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  int64_t* dst = out.data_ptr<int64_t>();
  at::parallel_for(0, batch * seq, 2048, [&](int64_t begin, int64_t end) {
    uint64_t history[kMaxWindow];
    for (int64_t token = begin; token < end; ++token) {
      const int64_t t = token % seq;
      const int64_t* row = ids + (token - t);
      for (int64_t k = 0; k < window; ++k) history[k] = static_cast<uint64_t>(t >= k ? row[t - k] : pad_id);
      hash_branches(history, mult, mod, off, branches, window, dst + token * branches);
    }
  });
  return out;
}

// Every row index in [0, rows), checked before a kernel allocates or touches anything: one
// vectorized min/max pass (the index array is a small fraction of the rows' bytes), and on failure
// the first offending value and its flat position.  The error is raised with no tensor of this
// module's own alive: on one GPU machine (GCC 13.3, torch 2.11) an error raised while a tensor
// allocated here was still alive crashed the process instead.
void check_row_range(const torch::Tensor& flat_indices, int64_t rows, const char* op) {
  if (flat_indices.numel() == 0) return;
  int64_t lowest = 0, highest = 0;
  {
    const auto [min_index, max_index] = flat_indices.aminmax();
    lowest = min_index.item<int64_t>();
    highest = max_index.item<int64_t>();
  }
  if (lowest >= 0 && highest < rows) return;
  const auto flat = flat_indices.reshape(-1);  // positions in flat order, whatever the caller's shape
  const int64_t bad = flat.lt(0).logical_or_(flat.ge(rows)).nonzero()[0][0].item<int64_t>();
  const int64_t value = flat.data_ptr<int64_t>()[bad];
  TORCH_CHECK(false, op, ": row index ", value, " at flat position ", bad, " is outside the table's rows [0, ", rows,
              ")");
}

torch::Tensor gather_rows_forward(torch::Tensor weight, torch::Tensor flat_indices) {
  check_long(flat_indices, "flat_indices");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.device().is_cpu(),
              "fe_megatron cpp: weight must be a contiguous CPU [rows, width] tensor");
  check_float(weight, "weight");
  const int64_t count = flat_indices.numel(), rows = weight.size(0), width = weight.size(1);
  check_row_range(flat_indices, rows, "gather_rows");  // before anything is allocated or copied
  auto out = torch::empty({count, width}, weight.options());
  const int64_t* idx = flat_indices.data_ptr<int64_t>();
  const size_t row_bytes = static_cast<size_t>(width) * weight.element_size();
  const char* src = static_cast<const char*>(weight.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, count, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (i + kPrefetchDistance < end) {  // rows are scattered over GBs: start the next misses early
        __builtin_prefetch(src + idx[i + kPrefetchDistance] * row_bytes);
      }
      std::memcpy(dst + i * row_bytes, src + idx[i] * row_bytes, row_bytes);
    }
  });
  return out;
}

template <typename out_t>
inline void add_row(out_t* __restrict out_row, const float* __restrict acc, int64_t width) {
  for (int64_t j = 0; j < width; ++j) out_row[j] = static_cast<out_t>(static_cast<float>(out_row[j]) + acc[j]);
}

template <typename grad_t>
inline void accumulate(float* __restrict acc, const grad_t* __restrict g, int64_t width) {
  for (int64_t j = 0; j < width; ++j) acc[j] += static_cast<float>(g[j]);
}

template <typename grad_t, typename out_t>
void sorted_backward(const grad_t* grad, const int64_t* sorted, const int64_t* perm, out_t* out, int64_t count,
                     int64_t width) {
  const int64_t chunks = (count + kChunk - 1) / kChunk;
  // Fragments of runs that cross a chunk boundary: the chunk's leading continuation and
  // its trailing run that starts here and goes on past the chunk.
  std::vector<float> first_storage(chunks * width), last_storage(chunks * width);
  float* first = first_storage.data();
  float* last = last_storage.data();
  at::parallel_for(0, chunks, 16, [&](int64_t c_begin, int64_t c_end) {
    std::vector<float> acc_storage(width, 0.f);
    float* acc = acc_storage.data();
    for (int64_t c = c_begin; c < c_end; ++c) {
      const int64_t lo = c * kChunk, hi = std::min(lo + kChunk, count);
      int64_t start = lo;
      for (int64_t i = lo; i < hi; ++i) {
        accumulate(acc, grad + perm[i] * width, width);
        if (i + 1 < hi && sorted[i + 1] == sorted[i]) continue;
        const int64_t row = sorted[i];
        const bool starts_here = start > 0 ? sorted[start - 1] != row : true;
        const bool ends_here = i + 1 == count || sorted[i + 1] != row;
        if (starts_here && ends_here) {
          add_row(out + row * width, acc, width);
        } else {
          std::memcpy((starts_here ? last : first) + c * width, acc, width * sizeof(float));
        }
        std::memset(acc, 0, width * sizeof(float));
        start = i + 1;
      }
    }
  });
  // Each run that crosses a boundary is finished by the chunk holding its head, in chunk order.
  at::parallel_for(0, chunks, 64, [&](int64_t c_begin, int64_t c_end) {
    std::vector<float> total_storage(width);
    float* total = total_storage.data();
    for (int64_t c = c_begin; c < c_end; ++c) {
      const int64_t lo = c * kChunk, e = std::min(lo + kChunk, count) - 1;
      const int64_t row = sorted[e];
      const bool continues = e + 1 < count && sorted[e + 1] == row;
      const bool head_here = lo == 0 || sorted[lo - 1] != row;
      if (!continues || !head_here) continue;
      std::memcpy(total, last + c * width, width * sizeof(float));
      for (int64_t k = c + 1; k < chunks && sorted[k * kChunk] == row; ++k) {
        accumulate(total, first + k * width, width);
        const int64_t ek = std::min((k + 1) * kChunk, count) - 1;
        if (sorted[ek] != row || ek + 1 == count || sorted[ek + 1] != row) break;
      }
      add_row(out + row * width, total, width);
    }
  });
}

// fp32 `out`: each thread owns a range of rows, scans all indices and adds its rows'
// gradients in position order: no sort, deterministic, and the same order (so the same
// bits) as the reference's sequential index_add.
template <typename grad_t>
void row_partitioned_backward(const grad_t* grad, const int64_t* idx, float* out, int64_t count, int64_t rows,
                              int64_t width) {
  const int64_t parts = std::max<int64_t>(1, at::get_num_threads());
  at::parallel_for(0, parts, 1, [&](int64_t p_begin, int64_t p_end) {
    const int64_t lo = rows * p_begin / parts, hi = rows * p_end / parts;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t r = idx[i];
      if (r >= lo && r < hi) accumulate(out + r * width, grad + i * width, width);
    }
  });
}

// out[i] += the gradients of every lookup of row i.  fp32 `out`: row-partitioned, in
// position order.  bf16/fp16 `out`: sorted chunks, duplicates summed in fp32 and each
// unique row written once.  Both are deterministic; `deterministic` is accepted for a
// uniform contract with the GPU backends.
void gather_rows_backward(torch::Tensor grad_rows, torch::Tensor flat_indices, torch::Tensor out,
                          bool deterministic) {
  (void)deterministic;
  check_long(flat_indices, "flat_indices");
  TORCH_CHECK(grad_rows.is_contiguous() && out.is_contiguous() && out.dim() == 2 && grad_rows.dim() == 2 &&
                  grad_rows.size(1) == out.size(1) && grad_rows.size(0) == flat_indices.numel(),
              "fe_megatron cpp: gather_rows_backward expects grad_rows [M, w], flat_indices [M], out [rows, w]");
  check_float(grad_rows, "grad_rows");
  check_float(out, "out");
  const int64_t count = flat_indices.numel();
  if (count == 0) return;
  check_row_range(flat_indices, out.size(0), "gather_rows backward");
  if (out.scalar_type() == torch::kFloat32) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad_rows.scalar_type(), "grad_rows", [&] {
      row_partitioned_backward<scalar_t>(grad_rows.data_ptr<scalar_t>(), flat_indices.data_ptr<int64_t>(),
                                         out.data_ptr<float>(), count, out.size(0), grad_rows.size(1));
    });
    return;
  }
  auto sorted_and_perm = flat_indices.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false);
  const auto& sorted = std::get<0>(sorted_and_perm);
  const auto& perm = std::get<1>(sorted_and_perm);
  // (double is refused above: these kernels accumulate in fp32)
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad_rows.scalar_type(), "grad_rows", [&] {
    using grad_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "out", [&] {
      sorted_backward<grad_t, scalar_t>(grad_rows.data_ptr<grad_t>(), sorted.data_ptr<int64_t>(),
                                        perm.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), count, grad_rows.size(1));
    });
  });
}

// ---------------------------------------------------------------------------- the table optimizer's update
// One AdamW step of a table in place, in one pass over the table (no temporaries): what the host
// tier's optimizer runs.  Semantics: reference.table_adamw_ (torch's single-tensor AdamW order,
// bf16 results stochastically rounded with counter_noise of each element's global id).

constexpr uint64_t kLow31 = 0x7FFFFFFF;

inline uint64_t mix31(uint64_t x) {  // reference._mix31: every intermediate < 2^58
  x ^= x >> 16;
  x = (x * 0x45D9F3BULL) & kLow31;
  x ^= x >> 16;
  x = (x * 0x45D9F3BULL) & kLow31;
  return x ^ (x >> 16);
}

inline uint32_t counter_noise(uint64_t key1, uint64_t key2, uint64_t id) {
  return static_cast<uint32_t>((mix31(mix31((id & kLow31) ^ key1) ^ (id >> 31) ^ key2) >> 8) & 0xFFFF);
}

inline float load(float v) { return v; }
inline float load(at::BFloat16 v) { return static_cast<float>(v); }

inline void store(float* dst, float value, uint32_t) { *dst = value; }
inline void store(at::BFloat16* dst, float value, uint32_t noise) {  // reference.stochastic_round_to_bf16
  if (!std::isfinite(value)) {
    *dst = at::BFloat16(value);
    return;
  }
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  bits = (bits + noise) & 0xFFFF0000u;  // unsigned: wraps as torch's int32 add does
  dst->x = static_cast<uint16_t>(bits >> 16);
}

template <typename P, typename G, typename S>
void table_adamw_kernel(P* param, const G* grad, S* exp_avg, S* exp_avg_sq, const int64_t* global_rows,
                        int64_t rows, int64_t width, int64_t column_offset, int64_t global_width, const int64_t* keys,
                        float decay, float weight1, float beta2, float weight2, float bias_correction2_sqrt, float eps,
                        float step_size) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint64_t first_id = static_cast<uint64_t>(global_rows[r] * global_width + column_offset);
      for (int64_t c = 0; c < width; ++c) {
        const int64_t i = r * width + c;
        const float g = load(grad[i]);
        float p = load(param[i]) * decay;                                  // param.mul_(1 - lr wd)
        float m = load(exp_avg[i]);
        m = std::fma(weight1, g - m, m);                                   // exp_avg.lerp_(grad, 1 - beta1)
        float v = load(exp_avg_sq[i]) * beta2 + weight2 * g * g;           // mul_(beta2).addcmul_(g, g, 1 - beta2)
        const float denom = std::sqrt(v) / bias_correction2_sqrt + eps;   // (sqrt / bc2).add_(eps)
        p = p + step_size * (m / denom);                                   // addcdiv_(m, denom, -lr / bc1)
        const uint64_t id = first_id + static_cast<uint64_t>(c);
        store(param + i, p, counter_noise(keys[0], keys[1], id));
        store(exp_avg + i, m, counter_noise(keys[2], keys[3], id));
        store(exp_avg_sq + i, v, counter_noise(keys[4], keys[5], id));
      }
    }
  });
}

void table_adamw_(torch::Tensor param, torch::Tensor grad, torch::Tensor exp_avg, torch::Tensor exp_avg_sq,
                  torch::Tensor global_rows, int64_t column_offset, int64_t global_width, torch::Tensor keys, double lr,
                  double beta1, double beta2, double eps, double weight_decay, int64_t step) {
  check_long(global_rows, "global_rows");
  check_long(keys, "keys");
  for (const auto* t : {&param, &grad, &exp_avg, &exp_avg_sq}) {
    TORCH_CHECK(t->is_contiguous() && t->device().is_cpu() && t->sizes() == param.sizes() &&
                    (t->scalar_type() == torch::kFloat32 || t->scalar_type() == torch::kBFloat16),
                "fe_megatron cpp: table_adamw_ takes contiguous fp32 or bf16 CPU tensors of the table's shape");
  }
  TORCH_CHECK(exp_avg.scalar_type() == exp_avg_sq.scalar_type() && keys.numel() == 6 && param.dim() == 2 &&
                  global_rows.numel() == param.size(0),
              "fe_megatron cpp: table_adamw_ expects moments of one dtype, keys [3, 2] and global_rows [rows]");
  // the scalars as torch turns the Python numbers into float operands
  const float decay = static_cast<float>(1.0 - lr * weight_decay), weight1 = static_cast<float>(1.0 - beta1);
  const float beta2f = static_cast<float>(beta2), weight2 = static_cast<float>(1.0 - beta2);
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const float bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, static_cast<double>(step))));
  const float step_size = static_cast<float>(-lr / bias_correction1);
  const auto run = [&](auto* p, const auto* g, auto* m, auto* v) {
    table_adamw_kernel(p, g, m, v, global_rows.data_ptr<int64_t>(), param.size(0), param.size(1), column_offset,
                       global_width, keys.data_ptr<int64_t>(), decay, weight1, beta2f, weight2, bias_correction2_sqrt,
                       static_cast<float>(eps), step_size);
  };
  const auto with_state = [&](auto* p, const auto* g) {
    if (exp_avg.scalar_type() == torch::kFloat32) {
      run(p, g, exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>());
    } else {
      run(p, g, exp_avg.data_ptr<at::BFloat16>(), exp_avg_sq.data_ptr<at::BFloat16>());
    }
  };
  const auto with_grad = [&](auto* p) {
    if (grad.scalar_type() == torch::kFloat32) {
      with_state(p, grad.data_ptr<float>());
    } else {
      with_state(p, grad.data_ptr<at::BFloat16>());
    }
  };
  if (param.scalar_type() == torch::kFloat32) {
    with_grad(param.data_ptr<float>());
  } else {
    with_grad(param.data_ptr<at::BFloat16>());
  }
}

// ---------------------------------------------------------------------------- row-wise AdaGrad on the touched rows
// One pass over each touched row (FBGEMM's fused EXACT_ROWWISE_ADAGRAD, without the backward): its mean squared
// gradient, its accumulator, and the row itself, where the torch composition reads and writes the rows about
// eight times.  Semantics: reference.rowwise_adagrad_rows_ (fp32 tables; sorted, unique ids).

void rowwise_adagrad_rows_(torch::Tensor param, torch::Tensor momentum, torch::Tensor ids, torch::Tensor grad,
                           int64_t global_width, double lr, double eps, double weight_decay) {
  check_long(ids, "ids");
  TORCH_CHECK(param.dim() == 2 && param.is_contiguous() && param.device().is_cpu() &&
                  param.scalar_type() == torch::kFloat32,
              "fe_megatron cpp: rowwise_adagrad_rows_ updates a contiguous fp32 CPU table [rows, width]");
  TORCH_CHECK(momentum.device().is_cpu() && momentum.is_contiguous() && momentum.scalar_type() == torch::kFloat32 &&
                  momentum.numel() == param.size(0),
              "fe_megatron cpp: rowwise_adagrad_rows_ needs one fp32 accumulator per table row, got ", momentum.numel(),
              " for ", param.size(0), " rows");
  TORCH_CHECK(grad.device().is_cpu() && grad.dim() == 2 && grad.is_contiguous() && grad.scalar_type() == torch::kFloat32 &&
                  grad.size(0) == ids.numel() && grad.size(1) == param.size(1),
              "fe_megatron cpp: rowwise_adagrad_rows_ needs fp32 gradients [ids, width] = [", ids.numel(), ", ",
              param.size(1), "]");
  TORCH_CHECK(global_width > 0, "fe_megatron cpp: rowwise_adagrad_rows_: global_width must be > 0");
  const int64_t count = ids.numel(), width = param.size(1), rows = param.size(0);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t u = 0; u < count; ++u) {  // before any write: a bad id changes nothing
    TORCH_CHECK(id[u] >= 0 && id[u] < rows, "fe_megatron cpp: rowwise_adagrad_rows_: row id ", id[u], " at position ",
                u, " is outside [0, ", rows, ")");
    TORCH_CHECK(u == 0 || id[u] > id[u - 1], "fe_megatron cpp: rowwise_adagrad_rows_ needs sorted, unique row ids; id ",
                id[u], " at position ", u, " follows ", id[u - 1]);
  }
  float* p = param.data_ptr<float>();
  float* m = momentum.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  // the scalars as torch turns the Python numbers into float operands
  const float gw = static_cast<float>(global_width), epsf = static_cast<float>(eps);
  const float decay = static_cast<float>(1.0 - lr * weight_decay), value = static_cast<float>(-lr);
  const bool decays = weight_decay != 0.0;
  at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const float* gu = g + u * width;
      double squares = 0.0;  // in double: a long row summed in order stays within the reference's rounding
      for (int64_t c = 0; c < width; ++c) squares += static_cast<double>(gu[c]) * gu[c];
      const float accumulated = m[id[u]] + static_cast<float>(squares) / gw;  // momentum[ids] + mean_c(g^2)
      m[id[u]] = accumulated;
      const float denominator = std::sqrt(accumulated) + epsf;
      float* row = p + id[u] * width;
      for (int64_t c = 0; c < width; ++c) {
        float w = decays ? row[c] * decay : row[c];  // rows.mul_(1 - lr wd)
        row[c] = w + value * (gu[c] / denominator);  // addcdiv_(g, denominator, -lr)
      }
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fe_megatron CPU kernels: n-gram hash, row gather, deduplicated table backward, table AdamW, "
            "the basis-gated reconstruction";
  m.attr("CHUNK") = kChunk;
  // The kernels touch only tensors: they release the GIL, so the host tier's worker thread and the
  // threads issuing GPU work run beside them.
  const auto release = py::call_guard<py::gil_scoped_release>();
  m.def("ngram_hash", &ngram_hash, "multi-head n-gram hash of all branches (Eq. 1, 6)", release);
  m.def("gather_rows_forward", &gather_rows_forward, "weight[flat_indices]", release);
  m.def("gather_rows_backward", &gather_rows_backward, "out[i] += deduplicated row gradients", release);
  m.def("table_adamw_", &table_adamw_, "one AdamW step of a table, bf16 results stochastically rounded", release);
  m.def("rowwise_adagrad_rows_", &rowwise_adagrad_rows_, "row-wise AdaGrad of the touched rows, one pass each",
        release);
  m.def("gated_reconstruction_forward", &gated_reconstruction_forward, "D^T (z * sigmoid(D q / sqrt(d))) (Eq. 7-9)",
        release);
  m.def("gated_reconstruction_backward", &gated_reconstruction_backward,
        "gradients of the gated reconstruction, the gate recomputed", release);
  m.def("basis_memory_values", &basis_memory_values, "V D^T (z * sigmoid(D RMSNorm(Q^T h) / sqrt(d))) (Eq. 7-9)",
        release);
  m.def("ngram_hash_decode_", &ngram_hash_decode_, "a decoding step's addresses (Eq. 1), the id state advanced",
        release);
  m.def("short_conv_decode_", &short_conv_decode_, "one decoding step of the refinement (Eq. 10), the state advanced",
        release);
}
