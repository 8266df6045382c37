// The sampling math of rows whose kept set runs past the top window, one row at a time on a
// CPU (specdec/core/nucleus.py, specdec/core/next_token.py): a row's few passes over its
// vocabulary in one call, instead of the ~40 small torch ops each pass of the tensor path
// dispatches. Every row is computed alone, so its result does not depend on the rows beside
// it. Exps are ATen's own (one vectorised call a row, on a buffer of the row's length); sums
// are sequential float64 sums in vocabulary (or rank) order.

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <unordered_map>
#include <vector>

namespace {

constexpr int64_t BINS_PER_NAT = 16;  // as nucleus.py: 16 bins a nat, 1024 bins
constexpr int64_t BINS = 1024;

// exp of the first n values of buf, in place, through ATen (vectorised, one dispatch)
void exp_inplace(double* buf, int64_t n) {
  if (n > 0) torch::from_blob(buf, {n}, torch::kFloat64).exp_();
}

// torch's `.long()` of a float then `.clamp(0, BINS - 1)`: values past int64 (inf, NaN) convert
// to INT64_MIN on x86, so they land in bin 0 as the tensor path puts them
int64_t bin_of(float depth) {
  int64_t b;
  if (!(depth > -9.2e18f && depth < 9.2e18f))
    b = std::numeric_limits<int64_t>::min();
  else
    b = static_cast<int64_t>(depth);
  return std::min<int64_t>(std::max<int64_t>(b, 0), BINS - 1);
}

// (τ, log Z) of one row's top-p nucleus (nucleus.py, `nucleus_cuts`): a histogram of its mass
// over bins of z locates the bin where the cumulative mass reaches top_p; only that bin's
// values are ordered to find the exact cut.
void nucleus_row(const float* z, int64_t vocab, float z_max, double top_p, double log_norm,
                 std::vector<int16_t>& depth, std::vector<double>& p, float* tau_out,
                 double* log_z_out) {
  for (int64_t i = 0; i < vocab; ++i) {
    depth[i] = static_cast<int16_t>(bin_of((z_max - z[i]) * static_cast<float>(BINS_PER_NAT)));
    p[i] = static_cast<double>(z[i]) - log_norm;
  }
  exp_inplace(p.data(), vocab);
  double mass[BINS] = {0.0}, cum[BINS];
  for (int64_t i = 0; i < vocab; ++i) mass[depth[i]] += p[i];
  double running = 0.0;
  int64_t b = 0;  // the bin where the nucleus ends: the number of cumulative masses < top_p
  for (int64_t j = 0; j < BINS; ++j) {
    running += mass[j];
    cum[j] = running;
    b += running < top_p;
  }
  b = std::min(b, BINS - 1);
  // rounding can leave the cut past the last bin holding tokens (top_p above the row's
  // summed mass): the deepest bin holding tokens then ends it
  std::vector<float> inside;
  for (; b >= 0; --b) {
    for (int64_t i = 0; i < vocab; ++i)
      if (depth[i] == b) inside.push_back(z[i]);
    if (!inside.empty()) break;
  }
  b = std::max<int64_t>(b, 0);
  const double above = b > 0 ? cum[b - 1] : 0.0;
  std::sort(inside.begin(), inside.end(), [](float a, float c) { return a > c; });
  const int64_t count = static_cast<int64_t>(inside.size());
  std::vector<double> p_in(count);
  for (int64_t j = 0; j < count; ++j) p_in[j] = static_cast<double>(inside[j]) - log_norm;
  exp_inplace(p_in.data(), count);
  int64_t n = 0;
  running = 0.0;
  for (int64_t j = 0; j < count; ++j) {  // mass strictly above each rank, as the tensor path
    running += p_in[j];
    if (above + running - p_in[j] < top_p) ++n;
  }
  const float tau = count ? inside[std::max<int64_t>(n, 1) - 1] : -INFINITY;
  double kept = 0.0;
  for (int64_t j = 0; j < count; ++j)
    if (inside[j] >= tau) kept += p_in[j];  // ties at the cut kept too
  *tau_out = tau;
  *log_z_out = log_norm + std::log(above + kept);
}

// rows [R, vocab] as a contiguous float32 CPU tensor
torch::Tensor float_rows(torch::Tensor x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu(), name,
              " must be a 2-d float32 CPU tensor");
  return x.contiguous();
}

// one value a row, as `type`, contiguous
torch::Tensor per_row(const torch::Tensor& x, int64_t rows, torch::ScalarType type,
                      const char* name) {
  TORCH_CHECK(x.numel() == rows, name, ": one value a row");
  return x.to(type).contiguous();
}

}  // namespace

// z [U, vocab] float32 (logits / T), z_max [U] float32, top_p [U] float64, log_norm [U]
// float64 (each row's log-mass) -> (τ [U] float32, log Z [U] float64)
std::vector<torch::Tensor> nucleus(torch::Tensor z, torch::Tensor z_max, torch::Tensor top_p,
                                   torch::Tensor log_norm) {
  z = float_rows(z, "z");
  const int64_t rows = z.size(0), vocab = z.size(1);
  auto zm = per_row(z_max, rows, torch::kFloat32, "z_max");
  auto tp = per_row(top_p, rows, torch::kFloat64, "top_p");
  auto ln = per_row(log_norm, rows, torch::kFloat64, "log_norm");
  auto tau = torch::empty({rows}, z.options());
  auto log_z = torch::empty({rows}, z.options().dtype(torch::kFloat64));
  std::vector<int16_t> depth(vocab);
  std::vector<double> p(vocab);
  for (int64_t r = 0; r < rows; ++r)
    nucleus_row(z.data_ptr<float>() + r * vocab, vocab, zm.data_ptr<float>()[r],
                tp.data_ptr<double>()[r], ln.data_ptr<double>()[r], depth, p,
                tau.data_ptr<float>() + r, log_z.data_ptr<double>() + r);
  return {tau, log_z};
}

// The recovered token (from the residual max(p − q̃, 0), where `rejected`) or the bonus token
// (from p) of each row, by inverse CDF in vocabulary order with its uniform u: the dense draw
// (next_token.py, `draw_next`) without a dense row. p(v) = exp(z_v − log Z) where z_v ≥ τ,
// z = logits / T in float32; q̃ given as K (id, probability) pairs a row (K may be 0).
// logits [S, vocab] float32; temperature, tau [S] float32; log_z, u [S] float64; q_ids [S, K]
// int64; q_probs [S, K] float64; rejected [S] bool -> tokens [S] int64
torch::Tensor draw(torch::Tensor logits, torch::Tensor temperature, torch::Tensor tau,
                   torch::Tensor log_z, torch::Tensor q_ids, torch::Tensor q_probs,
                   torch::Tensor rejected, torch::Tensor u) {
  logits = float_rows(logits, "logits");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  auto temp = per_row(temperature, rows, torch::kFloat32, "temperature");
  auto ta = per_row(tau, rows, torch::kFloat32, "tau");
  auto lz = per_row(log_z, rows, torch::kFloat64, "log_z");
  auto uu = per_row(u, rows, torch::kFloat64, "u");
  auto rej = per_row(rejected, rows, torch::kBool, "rejected");
  auto qi = q_ids.to(torch::kInt64).contiguous();
  auto qp = q_probs.to(torch::kFloat64).contiguous();
  const int64_t k = qi.numel() ? qi.size(1) : 0;
  TORCH_CHECK(k == 0 || (qi.size(0) == rows && qp.sizes() == qi.sizes()),
              "q_ids and q_probs: [rows, K]");
  auto out = torch::empty({rows}, logits.options().dtype(torch::kInt64));
  std::vector<double> w(vocab);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = logits.data_ptr<float>() + r * vocab;
    const float t = temp.data_ptr<float>()[r], cut = ta.data_ptr<float>()[r];
    const double norm = lz.data_ptr<double>()[r];
    for (int64_t v = 0; v < vocab; ++v) {
      const float z = row[v] / t;
      w[v] = z >= cut ? static_cast<double>(z) - norm : -INFINITY;
    }
    exp_inplace(w.data(), vocab);
    if (k > 0 && rej.data_ptr<bool>()[r]) {  // the residual: p less q̃ at q̃'s tokens
      std::unordered_map<int64_t, double> q;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t id = qi.data_ptr<int64_t>()[r * k + j];
        TORCH_CHECK(id >= 0 && id < vocab, "q_ids out of the vocabulary");
        q[id] += qp.data_ptr<double>()[r * k + j];
      }
      std::vector<std::pair<int64_t, double>> saved;
      double residual = 0.0;
      for (const auto& [id, qv] : q) {
        saved.emplace_back(id, w[id]);
        w[id] = std::max(w[id] - qv, 0.0);
      }
      for (int64_t v = 0; v < vocab; ++v) residual += w[v];
      if (!(residual > 0.0))  // no residual mass: reachable by rounding only; p instead
        for (const auto& [id, pv] : saved) w[id] = pv;
    }
    double total = 0.0;
    int64_t last_positive = 0;
    for (int64_t v = 0; v < vocab; ++v) {
      total += w[v];
      if (w[v] > 0.0) last_positive = v;
    }
    const double target = uu.data_ptr<double>()[r] * total;
    double cdf = 0.0;
    int64_t index = vocab;
    for (int64_t v = 0; v < vocab; ++v) {  // searchsorted(cdf, target, right=True)
      cdf += w[v];
      if (cdf > target) {
        index = v;
        break;
      }
    }
    out.data_ptr<int64_t>()[r] = std::min(index, last_positive);
  }
  return out;
}

// log Σ_{z ≥ τ} exp(z) over whole rows (logsum.py, `full_lse`): z = logits / T, or where
// `scaled` logits · (1 / T) (float32 reciprocal; top-p's whole-row normaliser); exps in float32
// relative to z_max, added in float64 in vocabulary order. logits [R, vocab] float32;
// temperature, tau, z_max [R] float32 (τ −inf: every token); scaled [R] bool -> [R] float64
torch::Tensor lse(torch::Tensor logits, torch::Tensor temperature, torch::Tensor tau,
                  torch::Tensor z_max, torch::Tensor scaled) {
  logits = float_rows(logits, "logits");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  auto temp = per_row(temperature, rows, torch::kFloat32, "temperature");
  auto ta = per_row(tau, rows, torch::kFloat32, "tau");
  auto zm = per_row(z_max, rows, torch::kFloat32, "z_max");
  auto sc = per_row(scaled, rows, torch::kBool, "scaled");
  auto out = torch::empty({rows}, logits.options().dtype(torch::kFloat64));
  std::vector<float> e(vocab);
  auto buffer = torch::from_blob(e.data(), {vocab}, torch::kFloat32);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = logits.data_ptr<float>() + r * vocab;
    const float t = temp.data_ptr<float>()[r], cut = ta.data_ptr<float>()[r];
    const float top = zm.data_ptr<float>()[r], inverse = 1.0f / t;
    if (sc.data_ptr<bool>()[r]) {
      for (int64_t v = 0; v < vocab; ++v) e[v] = row[v] * inverse - top;
    } else {
      for (int64_t v = 0; v < vocab; ++v) {
        const float z = row[v] / t;
        e[v] = z >= cut ? z - top : -INFINITY;
      }
    }
    buffer.exp_();
    double sum = 0.0;
    for (int64_t v = 0; v < vocab; ++v) sum += e[v];
    out.data_ptr<double>()[r] = std::log(sum) + static_cast<double>(top);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lse", &lse, "log-sums of whole rows over their kept sets");
  m.def("nucleus", &nucleus, "top-p cuts of rows whose nucleus is past the window");
  m.def("draw", &draw, "inverse-CDF draws of rows whose kept set is past the window");
}
