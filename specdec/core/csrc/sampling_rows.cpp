// The sampling math of a CPU's rows, one call for a batch of rows and each row computed alone
// (specdec/core/row_kernel.py): the cut of a top-p nucleus past the top window (nucleus.py),
// whole-row log-sums (logsum.py), the draw of the recovered or bonus token (next_token.py), a
// draft step's q̃ and candidate (proposal.py) and greedy's argmax (reduce.py) — a row's few
// passes over its vocabulary instead of the dozens of small torch ops each pass dispatches.
// A row's result does not depend on the rows beside it. Exps are ATen's own (one vectorised call
// a row, on a buffer of the row's length); sums that decide a cut or a draw are sequential in
// vocabulary (or rank) order where the tensor path's are, vectorised elsewhere.

#include <torch/extension.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <functional>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace {

constexpr int64_t BINS_PER_NAT = 16;  // as nucleus.py: 16 bins a nat, 1024 bins
constexpr int64_t BINS = 1024;
constexpr int64_t DRAW_BLOCK = 512;  // values a block of `draw`'s inverse CDF
constexpr int64_t ARGMAX_BLOCK = 1024;  // values a block of `argmax`'s pass
constexpr int64_t TOP_BLOCK = 64;  // values a block of `top`'s first pass (at most)
constexpr int64_t TOP_MIN_BLOCK = 16;  // (at least, else `top` keys every value)

// exp of the first n values of x in place, through ATen (vectorised, one dispatch), where
// keep[i] and the result is a normal number; 0 elsewhere (exp(−inf) = 0, and subnormal results
// are below anything a sum or a draw here can tell from 0). Neither −inf nor a subnormal result
// reaches ATen's exp: both take its slow path (~7× and ~180× a normal value's cost).
template <typename T>
void masked_exp(T* x, std::vector<uint8_t>& keep, int64_t n) {
  constexpr T low = std::is_same_v<T, double> ? T(-708) : T(-87);
  // branch-free (a flat row keeps about half its tokens at random: branches would mispredict)
  for (int64_t i = 0; i < n; ++i) {
    const bool k = (keep[i] != 0) & (x[i] >= low);
    keep[i] = k;
    x[i] = k ? x[i] : T(0);
  }
  if (n > 0)
    torch::from_blob(x, {n}, std::is_same_v<T, double> ? torch::kFloat64 : torch::kFloat32)
        .exp_();
  for (int64_t i = 0; i < n; ++i) x[i] = keep[i] ? x[i] : T(0);
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
                 std::vector<int16_t>& depth, std::vector<double>& p,
                 std::vector<uint8_t>& keep, float* tau_out,
                 double* log_z_out) {
  for (int64_t i = 0; i < vocab; ++i) {
    depth[i] = static_cast<int16_t>(bin_of((z_max - z[i]) * static_cast<float>(BINS_PER_NAT)));
    p[i] = static_cast<double>(z[i]) - log_norm;
    keep[i] = 1;
  }
  masked_exp(p.data(), keep, vocab);
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
  std::vector<uint8_t> keep_in(count, 1);
  masked_exp(p_in.data(), keep_in, count);
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

// exp of the first n float32 values of x in place, each first raised to EXP_FLOOR (what must count
// 0 is set to it by the caller): exp(−80) ≈ 1.8e−35 a value adds less than 1e−29 relative to a
// sum of whole-row masses, which hold exp(0) = 1 (their maximum), while neither −inf nor a
// subnormal result (below −87) reaches ATen's slow path. One pass, no mask.
constexpr float EXP_FLOOR = -80.0f;
void floor_exp(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] > EXP_FLOOR ? x[i] : EXP_FLOOR;
  if (n > 0) torch::from_blob(x, {n}, torch::kFloat32).exp_();
}

// Σ x in float64, in whatever order vectorises (a whole row's mass: exact to ~1e-16 relative)
template <typename T>
double vector_sum(const T* x, int64_t n) {
  double sum = 0.0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]);
  return sum;
}

// log Σ_{z ≥ cut} exp(z) over a whole row (logsum.py, `full_lse`): z = row / t, or where `scaled`
// row · (1 / t) (float32 reciprocal; top-p's whole-row normaliser, every token kept); exps in
// float32 relative to `top` (the row's largest z), added in float64. e: scratch, resized
double row_log_sum(const float* row, int64_t vocab, float t, float cut, float top, bool scaled,
                   std::vector<float>& e) {
  e.resize(vocab);
  if (scaled) {
    const float inverse = 1.0f / t;
    for (int64_t v = 0; v < vocab; ++v) e[v] = row[v] * inverse - top;
  } else {
    for (int64_t v = 0; v < vocab; ++v) {
      const float z = row[v] / t;
      e[v] = z >= cut ? z - top : EXP_FLOOR;
    }
  }
  floor_exp(e.data(), vocab);
  return std::log(vector_sum(e.data(), vocab)) + static_cast<double>(top);
}

// log Σ_{z ≥ cut} exp(z) over a window z[0, width) whose largest value is `top`, all in float64
// (logsum.py's `masked_lse` of a window)
double window_log_sum(const float* z, int64_t width, float cut, float top) {
  double sum = 0.0;
  for (int64_t j = 0; j < width; ++j)
    if (z[j] >= cut) sum += std::exp(static_cast<double>(z[j]) - static_cast<double>(top));
  return std::log(sum) + static_cast<double>(top);
}

// The processors' cut of one row (processed.py, `cuts`) from its window z[0, width) — the width
// largest z = row / t, descending: top-k's τ_k (the k-th largest z; from the whole row where k
// runs past the window), top-p's on the top-k renormalised distribution (its log-mass `log_k`
// from the window, or from the whole row where the top-k set runs past the window: the scaled
// sum without top-k), min-p's (z_max + log min_p, rounded to float32). `fits` is false where the
// nucleus may run past the window (its τ is then not final); log_k is NaN without top-p.
struct Cut {
  float tau;
  double log_k;
  bool fits;
};
Cut cut_row(const float* row, int64_t vocab, float t, const float* z, int64_t width,
            int64_t top_k, double top_p, double min_p, std::vector<float>& scratch) {
  const bool narrow = width < vocab;
  const float z_max = z[0];
  float tau_k = -INFINITY;
  if (top_k > 0 && top_k < vocab) {
    if (top_k <= width) {
      tau_k = z[top_k - 1];
    } else {  // the k-th largest past the window
      scratch.resize(vocab);
      for (int64_t v = 0; v < vocab; ++v) scratch[v] = row[v] / t;
      std::nth_element(scratch.begin(), scratch.begin() + (top_k - 1), scratch.end(),
                       std::greater<float>());
      tau_k = scratch[top_k - 1];
    }
  }
  Cut cut{tau_k, std::numeric_limits<double>::quiet_NaN(), true};
  if (top_p < 1.0) {
    cut.log_k = narrow && z[width - 1] >= tau_k
                    ? row_log_sum(row, vocab, t, tau_k, z_max, tau_k == -INFINITY, scratch)
                    : window_log_sum(z, width, tau_k, z_max);
    double cum = 0.0;
    int64_t kept = 0;
    for (int64_t j = 0; j < width; ++j) {  // mass strictly above each rank
      const double m = std::exp(static_cast<double>(z[j]) - cut.log_k);
      cum += m;
      kept += (cum - m < top_p) & (z[j] >= tau_k);
    }
    kept = std::max<int64_t>(kept, 1);
    cut.tau = std::max(cut.tau, z[kept - 1]);
    cut.fits = !(kept == width && narrow);
  }
  if (min_p > 0.0)
    cut.tau = std::max(cut.tau, static_cast<float>(z_max + std::log(std::max(min_p, 1e-300))));
  return cut;
}

// The largest of row[start, end) (−inf when empty) and whether a NaN is among them, in one
// vectorised pass (`top`'s and `argmax`'s blocks)
float block_max(const float* row, int64_t start, int64_t end, bool& nan) {
  float m = -INFINITY;
  int has_nan = 0;
#pragma omp simd reduction(max : m) reduction(| : has_nan)
  for (int64_t v = start; v < end; ++v) {
    m = row[v] > m ? row[v] : m;
    has_nan |= row[v] != row[v];
  }
  nan = has_nan != 0;
  return m;
}

// What `select_top` reuses from row to row
struct TopScratch {
  std::vector<float> maxima;
  std::vector<uint64_t> keys;
  std::vector<int64_t> order;
};

// The ids of the `width` largest of row[0, vocab) into out, descending; equal values by id
// (torch orders them as it likes), NaN above every number, as torch orders it: the window of
// `top` (the target's, processed.py) and of `draft`. The block maxima bound the answer from
// below: the width-th largest block maximum m has width blocks holding a value ≥ m, so the
// width largest values are all ≥ m — one vectorised pass for the maxima, one for the values ≥ m
// (usually a few times the width), a partial sort of those as integer keys. Blocks are smaller
// for wider windows (a large top-k); a window of more than a sixteenth of the row keys every
// value and selects (`nth_element`); a row holding a NaN sorts the whole row.
void select_top(const float* row, int64_t vocab, int64_t width, TopScratch& s, int64_t* out) {
  const int64_t size = std::min<int64_t>(TOP_BLOCK, vocab / width);
  const bool filter = size >= TOP_MIN_BLOCK;
  bool nan = false;
  if (filter) {
    const int64_t blocks = (vocab + size - 1) / size;
    s.maxima.resize(blocks);
    for (int64_t b = 0; b < blocks; ++b) {
      bool has_nan;
      s.maxima[b] = block_max(row, b * size, std::min(vocab, (b + 1) * size), has_nan);
      nan |= has_nan;
    }
  } else {
    block_max(row, 0, vocab, nan);
  }
  if (nan) {  // NaN first (by id), then the numbers: the whole row, by comparison
    s.order.resize(vocab);
    for (int64_t v = 0; v < vocab; ++v) s.order[v] = v;
    std::partial_sort(s.order.begin(), s.order.begin() + width, s.order.end(),
                      [&](int64_t a, int64_t b) {
                        const bool a_nan = row[a] != row[a], b_nan = row[b] != row[b];
                        if (a_nan || b_nan) return a_nan && (!b_nan || a < b);
                        return row[a] > row[b] || (row[a] == row[b] && a < b);
                      });
    std::copy(s.order.begin(), s.order.begin() + width, out);
    return;
  }
  float bound = -INFINITY;
  if (filter) {
    std::nth_element(s.maxima.begin(), s.maxima.begin() + (width - 1), s.maxima.end(),
                     std::greater<float>());
    bound = s.maxima[width - 1];
  }
  // each value ≥ the bound as one sortable key: larger value first, then lower id (the
  // float's bits made monotone, −0 as +0 so that they tie as they compare)
  s.keys.clear();
  for (int64_t v = 0; v < vocab; ++v) {
    const float f = row[v];
    if (!(f >= bound)) continue;
    uint32_t u;
    const float g = f == 0.0f ? 0.0f : f;
    std::memcpy(&u, &g, sizeof u);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    s.keys.push_back((static_cast<uint64_t>(~u) << 32) | static_cast<uint64_t>(v));
  }
  if (filter) {
    std::partial_sort(s.keys.begin(), s.keys.begin() + width, s.keys.end());
  } else {
    std::nth_element(s.keys.begin(), s.keys.begin() + (width - 1), s.keys.end());
    std::sort(s.keys.begin(), s.keys.begin() + width);
  }
  for (int64_t j = 0; j < width; ++j) out[j] = static_cast<int64_t>(s.keys[j] & 0xffffffffu);
}

// One sampling row's window and cut (`window`, and the draft's step): the ids of the `width`
// largest logits (`select_top`) into ids, their z = logits / t (as torch divides) into z, and
// `cut_row` over them
Cut window_row(const float* row, int64_t vocab, float t, int64_t width, int64_t top_k,
               double top_p, double min_p, TopScratch& top, std::vector<float>& scratch,
               int64_t* ids, float* z) {
  select_top(row, vocab, width, top, ids);
  for (int64_t j = 0; j < width; ++j) z[j] = row[ids[j]] / t;
  return cut_row(row, vocab, t, z, width, top_k, top_p, min_p, scratch);
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

// logits [U, vocab] float32, temperature, z_max [U] float32 (z = logits / T, z_max each row's
// largest z), top_p [U] float64, log_norm [U] float64 (each row's log-mass) -> (τ [U] float32,
// log Z [U] float64)
std::vector<torch::Tensor> nucleus(torch::Tensor logits, torch::Tensor temperature,
                                   torch::Tensor z_max, torch::Tensor top_p,
                                   torch::Tensor log_norm) {
  logits = float_rows(logits, "logits");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  auto temp = per_row(temperature, rows, torch::kFloat32, "temperature");
  auto zm = per_row(z_max, rows, torch::kFloat32, "z_max");
  auto tp = per_row(top_p, rows, torch::kFloat64, "top_p");
  auto ln = per_row(log_norm, rows, torch::kFloat64, "log_norm");
  auto tau = torch::empty({rows}, logits.options());
  auto log_z = torch::empty({rows}, logits.options().dtype(torch::kFloat64));
  std::vector<float> z(vocab);
  std::vector<int16_t> depth(vocab);
  std::vector<double> p(vocab);
  std::vector<uint8_t> keep(vocab);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = logits.data_ptr<float>() + r * vocab;
    const float t = temp.data_ptr<float>()[r];
    for (int64_t v = 0; v < vocab; ++v) z[v] = row[v] / t;  // as torch divides: IEEE, exact
    nucleus_row(z.data(), vocab, zm.data_ptr<float>()[r], tp.data_ptr<double>()[r],
                ln.data_ptr<double>()[r], depth, p, keep, tau.data_ptr<float>() + r,
                log_z.data_ptr<double>() + r);
  }
  return {tau, log_z};
}

// The recovered token (from the residual max(p − q̃, 0), where `rejected`) or the bonus token
// (from p) of processed rows, by inverse CDF in vocabulary order with each row's uniform u:
// the dense draw (next_token.py, `draw_next` over `Processed.dense` and `dense_q`) without a
// dense row, unless u · Σp falls within float64 rounding of a 512-value block's boundary.
// p(v) = exp(z_v − log Z) where z_v ≥ τ, z = logits / T in float32; q̃ from its
// integer wire weights, a token's weights summed, then divided by the row's total (`dense_q`).
// logits [N, vocab] float32 and temperature, tau [N] float32, log_z [N] float64: the
// processed rows; rows: the S rows drawn from; q_ids, q_weights: S lists (empty: no q̃);
// rejected, u: S values -> S tokens
std::vector<int64_t> draw(torch::Tensor logits, const std::vector<int64_t>& rows,
                          torch::Tensor temperature, torch::Tensor tau, torch::Tensor log_z,
                          const std::vector<std::vector<int64_t>>& q_ids,
                          const std::vector<std::vector<double>>& q_weights,
                          const std::vector<bool>& rejected, const std::vector<double>& u) {
  logits = float_rows(logits, "logits");
  const int64_t count = logits.size(0), vocab = logits.size(1);
  const int64_t drawn = static_cast<int64_t>(rows.size());
  auto temp = per_row(temperature, count, torch::kFloat32, "temperature");
  auto ta = per_row(tau, count, torch::kFloat32, "tau");
  auto lz = per_row(log_z, count, torch::kFloat64, "log_z");
  TORCH_CHECK(static_cast<int64_t>(u.size()) == drawn &&
                  static_cast<int64_t>(rejected.size()) == drawn &&
                  (q_ids.empty() || static_cast<int64_t>(q_ids.size()) == drawn) &&
                  q_weights.size() == q_ids.size(),
              "one u, rejected, q_ids and q_weights a drawn row");
  std::vector<int64_t> out(drawn);
  std::vector<double> w(vocab), block((vocab + DRAW_BLOCK - 1) / DRAW_BLOCK);
  std::vector<uint8_t> keep(vocab);
  for (int64_t s = 0; s < drawn; ++s) {
    const int64_t r = rows[s];
    TORCH_CHECK(r >= 0 && r < count, "rows: out of range");
    const float* row = logits.data_ptr<float>() + r * vocab;
    const float t = temp.data_ptr<float>()[r], cut = ta.data_ptr<float>()[r];
    const double norm = lz.data_ptr<double>()[r];
    for (int64_t v = 0; v < vocab; ++v) {
      const float z = row[v] / t;
      w[v] = static_cast<double>(z) - norm;
      keep[v] = z >= cut;
    }
    masked_exp(w.data(), keep, vocab);
    if (!q_ids.empty() && !q_ids[s].empty() && rejected[s]) {  // the residual
      const auto& ids = q_ids[s];
      const auto& weights = q_weights[s];
      TORCH_CHECK(ids.size() == weights.size(), "q_ids and q_weights: one weight an id");
      std::unordered_map<int64_t, double> q;  // token -> its weights summed
      double total_weight = 0.0;
      for (size_t j = 0; j < ids.size(); ++j) {
        TORCH_CHECK(ids[j] >= 0 && ids[j] < vocab, "q_ids: out of the vocabulary");
        q[ids[j]] += weights[j];
        total_weight += weights[j];
      }
      total_weight = std::max(total_weight, 1e-300);
      std::vector<std::pair<int64_t, double>> saved;
      for (const auto& [id, weight] : q) {
        saved.emplace_back(id, w[id]);
        w[id] = std::max(w[id] - weight / total_weight, 0.0);
      }
      if (!(vector_sum(w.data(), vocab) > 0.0))  // no residual mass: reachable by rounding only; p instead
        for (const auto& [id, pv] : saved) w[id] = pv;
    }
    // inverse CDF in two levels: the blocks' masses (vectorised), added in order to find the
    // block where u · total falls, then that block's values added in order from its start
    double total = 0.0;
    for (int64_t b = 0; b * DRAW_BLOCK < vocab; ++b) {
      const int64_t start = b * DRAW_BLOCK, len = std::min(DRAW_BLOCK, vocab - start);
      block[b] = vector_sum(w.data() + start, len);
      total += block[b];
    }
    int64_t last_positive = vocab - 1;
    while (last_positive > 0 && !(w[last_positive] > 0.0)) --last_positive;
    const double target = u[s] * total;
    double cdf = 0.0;
    int64_t b = 0;
    while (b * DRAW_BLOCK < vocab && !(cdf + block[b] > target)) cdf += block[b++];
    int64_t index = vocab;
    for (int64_t v = b * DRAW_BLOCK; v < vocab; ++v) {  // searchsorted(cdf, target, right=True)
      cdf += w[v];
      if (cdf > target) {
        index = v;
        break;
      }
    }
    out[s] = std::min(index, last_positive);
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
  std::vector<float> e;
  for (int64_t r = 0; r < rows; ++r)
    out.data_ptr<double>()[r] =
        row_log_sum(logits.data_ptr<float>() + r * vocab, vocab, temp.data_ptr<float>()[r],
                    ta.data_ptr<float>()[r], zm.data_ptr<float>()[r], sc.data_ptr<bool>()[r], e);
  return out;
}

// A draft step's q̃ and candidate for each sampled row (proposal.py, `propose_step`): the
// processed distribution's kept set {z ≥ τ} (temperature, top-k, top-p on the top-k
// renormalised distribution, min-p, as processed.py cuts them from a window of the W largest
// logits, W = max(64, K): `window_row`), q̃ = its K largest tokens with integer weights round(65535 · exp(z − z_max))
// (half to even), and the candidate drawn from q̃ by inverse CDF in rank order with the row's
// uniform u. logits [S, vocab] float32; temperature, top_k, top_p, min_p, u: S values each (the
// temperature rounded to float32); k: q̃'s entries -> (tokens [S], ids [S, k], weights [S, k])
std::vector<torch::Tensor> draft(torch::Tensor logits, const std::vector<double>& temperature,
                                 const std::vector<int64_t>& top_k,
                                 const std::vector<double>& top_p,
                                 const std::vector<double>& min_p, int64_t k,
                                 const std::vector<double>& u) {
  logits = float_rows(logits, "logits");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const auto n = static_cast<size_t>(rows);
  TORCH_CHECK(temperature.size() == n && top_k.size() == n && top_p.size() == n &&
                  min_p.size() == n && u.size() == n,
              "temperature, top_k, top_p, min_p, u: one a row");
  TORCH_CHECK(k >= 1 && k <= vocab, "k: 1 to the vocabulary");
  TORCH_CHECK(vocab <= (int64_t{1} << 32), "logits: at most 2^32 values a row");
  const int64_t width = std::min<int64_t>(vocab, std::max<int64_t>(64, k));
  auto tokens = torch::empty({rows}, torch::kInt64);
  auto ids = torch::empty({rows, k}, torch::kInt64);
  auto weights = torch::empty({rows, k}, torch::kInt64);
  std::vector<float> z(width), scratch;
  std::vector<int64_t> top(width);
  TopScratch window;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = logits.data_ptr<float>() + r * vocab;
    const float t = static_cast<float>(temperature[r]);  // as torch.tensor(float32) rounds it
    // the window (the W largest logits, descending) as z, and the processors' cut
    const float tau = window_row(row, vocab, t, width, top_k[r], top_p[r], min_p[r], window,
                                 scratch, top.data(), z.data())
                          .tau;
    const float z_max = z[0];
    // q̃: the K largest, integer weights; the candidate by inverse CDF over them
    int64_t* row_ids = ids.data_ptr<int64_t>() + r * k;
    int64_t* row_weights = weights.data_ptr<int64_t>() + r * k;
    double total = 0.0;
    for (int64_t j = 0; j < k; ++j) {
      const float zj = z[j];
      row_ids[j] = top[j];
      row_weights[j] = zj >= tau ? static_cast<int64_t>(std::nearbyint(
                                       std::exp(static_cast<double>(zj) - z_max) * 65535.0))
                                 : 0;
      total += static_cast<double>(row_weights[j]);
    }
    const double target = u[r] * total;
    int64_t index = k, last_positive = 0;
    double cdf = 0.0;
    for (int64_t j = 0; j < k; ++j) {
      cdf += static_cast<double>(row_weights[j]);
      if (index == k && cdf > target) index = j;
      if (row_weights[j] > 0) last_positive = j;
    }
    tokens.data_ptr<int64_t>()[r] = row_ids[std::min(index, last_positive)];
  }
  return {tokens, ids, weights};
}

// The processed distribution's cuts of sampling rows (processed.py, `_thresholds`): each row's
// window — the `width` largest logits (`select_top`) as z = logits / T, descending — its cut
// (`cut_row`: τ, top-p's log-mass log_k, whether the nucleus fits the window) and, with
// `with_log_z`, log Z = log Σ_{z ≥ τ} exp(z): from the window (float64) unless kept tokens run
// past it in a row whose nucleus fits (the whole row, `row_log_sum`; a row that does not fit
// is finished by the caller). logits [R, vocab] float32; temperature [R] float32; top_k, top_p,
// min_p [R] (0, 1, 0 = off); width (a top-k past it is found in the whole row) -> (τ [R] float32,
// log Z [R] float64 (NaN without with_log_z), fits [R] bool, log_k [R] float64 (NaN without
// top-p), z [R, width] float32, ids [R, width] int64)
std::vector<torch::Tensor> window(torch::Tensor logits, torch::Tensor temperature,
                                  torch::Tensor top_k, torch::Tensor top_p, torch::Tensor min_p,
                                  int64_t width, bool with_log_z) {
  logits = float_rows(logits, "logits");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(width >= 1 && width <= vocab, "width: 1 to the vocabulary");
  TORCH_CHECK(vocab <= (int64_t{1} << 32), "logits: at most 2^32 values a row (ids are 32-bit keys)");
  auto temp = per_row(temperature, rows, torch::kFloat32, "temperature");
  auto tk = per_row(top_k, rows, torch::kInt64, "top_k");
  auto tp = per_row(top_p, rows, torch::kFloat64, "top_p");
  auto mp = per_row(min_p, rows, torch::kFloat64, "min_p");
  auto tau = torch::empty({rows}, torch::kFloat32);
  auto log_z = torch::empty({rows}, torch::kFloat64);
  auto fits = torch::empty({rows}, torch::kBool);
  auto log_k = torch::empty({rows}, torch::kFloat64);
  auto z = torch::empty({rows, width}, torch::kFloat32);
  auto ids = torch::empty({rows, width}, torch::kInt64);
  std::vector<float> scratch;
  TopScratch top;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = logits.data_ptr<float>() + r * vocab;
    const float t = temp.data_ptr<float>()[r];
    const int64_t k = tk.data_ptr<int64_t>()[r];
    float* row_z = z.data_ptr<float>() + r * width;
    const Cut cut = window_row(row, vocab, t, width, k, tp.data_ptr<double>()[r],
                               mp.data_ptr<double>()[r], top, scratch,
                               ids.data_ptr<int64_t>() + r * width, row_z);
    double lz = std::numeric_limits<double>::quiet_NaN();
    if (with_log_z)
      lz = width < vocab && row_z[width - 1] >= cut.tau && cut.fits
               ? row_log_sum(row, vocab, t, cut.tau, row_z[0], false, scratch)
               : window_log_sum(row_z, width, cut.tau, row_z[0]);
    tau.data_ptr<float>()[r] = cut.tau;
    log_z.data_ptr<double>()[r] = lz;
    fits.data_ptr<bool>()[r] = cut.fits;
    log_k.data_ptr<double>()[r] = cut.log_k;
  }
  return {tau, log_z, fits, log_k, z, ids};
}

// The `width` largest values of each row of x [R, vocab] float32, descending, and their ids
// (`torch.topk` of the processors' window, processed.py; `select_top`) -> (values [R, width]
// float32, ids [R, width] int64)
std::vector<torch::Tensor> top(torch::Tensor x, int64_t width) {
  x = float_rows(x, "x");
  const int64_t rows = x.size(0), vocab = x.size(1);
  TORCH_CHECK(width >= 1 && width <= vocab, "width: 1 to the vocabulary");
  TORCH_CHECK(vocab <= (int64_t{1} << 32), "x: at most 2^32 values a row (ids are 32-bit keys)");
  auto values = torch::empty({rows, width}, torch::kFloat32);
  auto ids = torch::empty({rows, width}, torch::kInt64);
  TopScratch scratch;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x.data_ptr<float>() + r * vocab;
    int64_t* out_ids = ids.data_ptr<int64_t>() + r * width;
    select_top(row, vocab, width, scratch, out_ids);
    float* out_values = values.data_ptr<float>() + r * width;
    for (int64_t j = 0; j < width; ++j) out_values[j] = row[out_ids[j]];
  }
  return {values, ids};
}

// `torch.argmax` of each row of x [R, vocab] float32 (the first maximum; a row holding NaN: its
// first NaN, as torch's) -> [R] int64: greedy's candidate and verification (reduce.py)
torch::Tensor argmax(torch::Tensor x) {
  x = float_rows(x, "x");
  const int64_t rows = x.size(0), vocab = x.size(1);
  auto out = torch::empty({rows}, torch::kInt64);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x.data_ptr<float>() + r * vocab;
    // blocks' maxima (and whether they hold a NaN) in one vectorised pass, then the first
    // block holding the row's maximum (its first NaN) is scanned for its first occurrence
    int64_t block = -1;
    float top = -INFINITY;
    bool nan = false;
    for (int64_t start = 0; start < vocab && !nan; start += ARGMAX_BLOCK) {
      bool has_nan;
      const float m = block_max(row, start, std::min(vocab, start + ARGMAX_BLOCK), has_nan);
      if (has_nan || block < 0 || m > top) {
        top = m;
        block = start;
        nan = has_nan;
      }
    }
    int64_t best = std::max<int64_t>(block, 0);
    while (best < vocab - 1 && !(nan ? std::isnan(row[best]) : row[best] == top)) ++best;
    out.data_ptr<int64_t>()[r] = best;
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("argmax", &argmax, "the first maximum of each row");
  m.def("top", &top, "the largest values of each row and their ids, descending");
  m.def("window", &window, "the processors' window and cuts of sampling rows");
  m.def("draft", &draft, "a draft step's q̃ and candidates of sampled rows");
  m.def("lse", &lse, "log-sums of whole rows over their kept sets");
  m.def("nucleus", &nucleus, "top-p cuts of rows whose nucleus is past the window");
  m.def("draw", &draw, "inverse-CDF draws of rows whose kept set is past the window");
}
