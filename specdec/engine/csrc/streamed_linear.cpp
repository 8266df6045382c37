// A float32 linear layer for the few rows of a decode step or a verify pass, streaming its
// weight once per call (specdec/engine/kernels.py builds it and calls it).
//
// At one to a few dozen rows a CPU linear layer is bound by reading its weight from memory:
// a model's weights (126 MB for the code target, 538 MB for SmolLM2) do not stay in cache
// from one step to the next. oneDNN's prepacked kernels read them at ~9 GB/s on this
// machine's cores and MKL's sgemm at ~11 (one or two rows; less per row above that); one
// core reads memory at ~23 GB/s. Here the weight is laid out once at load as groups of
// WIDTH outputs, input by input: packed[g][i][k] = weight[g * WIDTH + k][i] (zero past the
// last output), so a call reads it as one sequential stream, and for each input i the WIDTH
// weights of a group meet every row's x[r][i] in WIDTH / LANES vector multiply-adds. Rows go in groups of at most MAX_ROWS,
// whose accumulators stay in registers; later row groups find the weight group in L2.
//
// Every output is one float32 sum over the inputs in order i = 0, 1, ..., each term added by
// one fused multiply-add, and the bias added last: the same operations whatever the row
// count, the row's place in the batch or the thread count, so a row's result does not
// depend on what it is batched with (torch's own and oneDNN's kernels choose their blocking,
// and with it the summation order, by the row count). The order differs from theirs: results
// agree with F.linear to rounding, which the check at load holds every layer to.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>

namespace {

#ifdef __AVX512F__
constexpr int64_t LANES = 16;    // one 512-bit register of float32
constexpr int64_t MAX_ROWS = 6;  // 4 x 6 accumulators + 4 weights: 28 of 32 registers
#else
constexpr int64_t LANES = 8;     // one 256-bit register (without AVX, GCC splits it in two)
constexpr int64_t MAX_ROWS = 2;  // 4 x 2 accumulators + 4 weights: 12 of 16 registers
#endif
constexpr int64_t VECTORS = 4;               // vectors of outputs a group fills
constexpr int64_t WIDTH = LANES * VECTORS;   // outputs per group: the layout's unit
constexpr int64_t PREFETCH = 16;             // inputs ahead (16 x WIDTH floats: 4 KiB)
// a vector of LANES floats at any 4-byte-aligned address (loads and stores through it may
// alias the tensors' float data)
typedef float vec __attribute__((vector_size(LANES * sizeof(float)), aligned(4), may_alias));

// One weight group against R rows: out[r][k] = sum_i w[i][k] * x[r][i]. The loops over
// vectors and rows unroll completely, so the VECTORS x R accumulators live in registers (an
// accumulator array whose address escapes, by memcpy, was stored to the stack every input:
// 3x slower at 6 rows). With two rows or more the loop's arithmetic hides the memory stream
// from the hardware prefetcher long enough to lose bandwidth; a prefetch 4 KiB ahead (into
// L2) keeps it streaming. One row streams faster without it.
template <int R>
inline void group_rows(const float* w, const float* x, int64_t in, float* out) {
  vec acc[VECTORS][R];
#pragma GCC unroll 8
  for (int k = 0; k < VECTORS; ++k)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[k][r] = vec{};
  for (int64_t i = 0; i < in; ++i) {
    const float* wi = w + i * WIDTH;
    if (R >= 2) {
#pragma GCC unroll 8
      for (int64_t line = 0; line < WIDTH; line += 64 / sizeof(float))
        __builtin_prefetch(wi + PREFETCH * WIDTH + line, 0, 1);
    }
    vec wv[VECTORS];
#pragma GCC unroll 8
    for (int k = 0; k < VECTORS; ++k) wv[k] = *reinterpret_cast<const vec*>(wi + k * LANES);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * in + i];
#pragma GCC unroll 8
      for (int k = 0; k < VECTORS; ++k) acc[k][r] += wv[k] * xv;
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int k = 0; k < VECTORS; ++k) *reinterpret_cast<vec*>(out + r * WIDTH + k * LANES) = acc[k][r];
}

// group_rows<rows> for 1 <= rows <= R
template <int R>
inline void rows_of(int64_t rows, const float* w, const float* x, int64_t in, float* out) {
  if (rows == R)
    group_rows<R>(w, x, in, out);
  else if constexpr (R > 1)
    rows_of<R - 1>(rows, w, x, in, out);
}

}  // namespace

// weight [out, in] float32 -> the packed layout [groups, in, WIDTH] (zero past `out`)
torch::Tensor pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32 && weight.device().is_cpu(),
              "weight must be a 2-d float32 CPU tensor");
  const int64_t out = weight.size(0), in = weight.size(1);
  const int64_t groups = (out + WIDTH - 1) / WIDTH;
  auto padded = torch::zeros({groups * WIDTH, in}, weight.options());
  padded.narrow(0, 0, out).copy_(weight);
  return padded.view({groups, WIDTH, in}).transpose(1, 2).contiguous();
}

// x [..., in] float32 -> x @ weight.T + bias [..., out_features]
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, std::optional<torch::Tensor> bias,
                     int64_t out_features) {
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu(),
              "x must be a float32 CPU tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == WIDTH && packed.size(1) == x.size(-1) &&
                  packed.is_contiguous() && out_features <= packed.size(0) * WIDTH,
              "packed weight does not match x");
  auto shape = x.sizes().vec();
  shape.back() = out_features;
  x = x.contiguous();
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->is_contiguous() &&
                    bias->scalar_type() == torch::kFloat32,
                "bias must be a contiguous float32 vector of out_features");
  const int64_t in = x.size(-1), rows = x.numel() / std::max<int64_t>(in, 1);
  const int64_t groups = packed.size(0);
  auto y = torch::empty(shape, x.options());
  if (rows == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t row_groups = (rows + MAX_ROWS - 1) / MAX_ROWS;  // balanced: 7 rows = 4 + 3
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    alignas(64) float buf[MAX_ROWS * WIDTH];
    for (int64_t g = g0; g < g1; ++g) {
      const float* w = wp + g * in * WIDTH;
      const int64_t o0 = g * WIDTH, n = std::min(WIDTH, out_features - o0);
      for (int64_t q = 0, r0 = 0; q < row_groups; ++q) {
        const int64_t rr = (rows - r0 + (row_groups - q) - 1) / (row_groups - q);
        rows_of<MAX_ROWS>(rr, w, xp + r0 * in, in, buf);
        for (int64_t r = 0; r < rr; ++r) {
          float* yr = yp + (r0 + r) * out_features + o0;
          const float* br = buf + r * WIDTH;
          if (bp != nullptr)
            for (int64_t k = 0; k < n; ++k) yr[k] = br[k] + bp[o0 + k];
          else
            std::memcpy(yr, br, n * sizeof(float));
        }
        r0 += rr;
      }
    }
  });
  return y;
}

// How many of torch's intra-op threads a parallel_for here runs on (1 where the module was
// built without OpenMP: ATen's parallel_for is then a serial loop).
int64_t threads_used() {
  std::atomic<int64_t> most{1};
  at::parallel_for(0, 1024, 1, [&](int64_t, int64_t) {
    const int64_t mine = at::get_thread_num() + 1;
    int64_t seen = most.load();
    while (mine > seen && !most.compare_exchange_weak(seen, mine)) {
    }
  });
  return most.load();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("threads_used", &threads_used, "threads a parallel_for of this module runs on");
  m.def("pack", &pack, "a linear layer's weight in the streamed layout");
  m.def("linear", &linear, "x @ weight.T + bias with the weight in the streamed layout",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
