// Attention of short blocks over each session's own KV buffers, all sessions of a layer in
// one call (specdec/engine/attention_kernel.py builds it; session_attention.py calls it).
//
// Torch's way costs one scaled_dot_product_attention call per session and layer, plus the
// slicing and copies around it: ~35 us of fixed cost each on a CPU core, more than the
// arithmetic of a block of a few queries over a few hundred cached keys. Here one call per
// layer writes every session's new keys and values into its buffers and attends with plain
// loops: for each (session, query head, query) the scores over keys 0..start+j, a softmax
// with the maximum subtracted, and the weighted sum of values, all in float32 as torch's CPU
// kernel accumulates. Summation order differs from torch's, so results agree to rounding
// (the check at load, session_attention._disagrees, holds every model to its own attention).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// e^x for x <= 0 (Cephes' expf: reduction by ln 2 in two parts, a degree-5 polynomial, the
// power of two put into the exponent bits; relative error ~1e-7). Plain arithmetic, so the
// loops below vectorise with it.
inline float exp_nonpositive(float x) {
  x = x < -87.3f ? -87.3f : x;
  const float k = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  float r = x - k * 0.693359375f;
  r = r + k * 2.12194440e-4f;
  const float r2 = r * r;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r2 + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

void check_block(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 4 && t.scalar_type() == torch::kFloat32 && t.device().is_cpu(),
              name, " must be a 4-d float32 CPU tensor");
  TORCH_CHECK(t.stride(3) == 1, name, "'s last dimension must be contiguous");
}

}  // namespace

// query [B, H, T, D], key and value [B, Hkv, T, D]: this pass's tokens, right-padded to T
// (any strides but the last). out [B, T, H, D]: rows of the sessions in `rows` are written,
// the others left as they are. keys[i], values[i]: session rows[i]'s buffers [Hkv, C, D],
// contiguous; its lengths[i] new keys and values are written at starts[i] first, then each
// of its queries j attends to keys 0..starts[i]+j.
void attend(torch::Tensor query, torch::Tensor key, torch::Tensor value, torch::Tensor out,
            std::vector<int64_t> rows, std::vector<torch::Tensor> keys,
            std::vector<torch::Tensor> values, std::vector<int64_t> starts,
            std::vector<int64_t> lengths, double scale) {
  check_block(query, "query");
  check_block(key, "key");
  check_block(value, "value");
  check_block(out, "out");
  TORCH_CHECK(out.is_contiguous(), "out must be contiguous");
  const int64_t B = query.size(0), H = query.size(1), T = query.size(2), D = query.size(3);
  const int64_t Hkv = key.size(1);
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "query heads must be a multiple of key heads");
  TORCH_CHECK(key.sizes() == value.sizes() && key.size(0) == B && key.size(2) == T &&
                  key.size(3) == D,
              "key and value must be [B, kv_heads, T, head_dim] like the query");
  TORCH_CHECK(out.size(0) == B && out.size(1) == T && out.size(2) == H && out.size(3) == D,
              "out must be [B, T, heads, head_dim]");
  const size_t n_rows = rows.size();
  TORCH_CHECK(keys.size() == n_rows && values.size() == n_rows && starts.size() == n_rows &&
                  lengths.size() == n_rows,
              "rows, keys, values, starts and lengths must have one entry per session");
  std::vector<float*> kp(n_rows), vp(n_rows);
  std::vector<int64_t> cap(n_rows);
  const auto ks = key.strides(), vs = value.strides(), qs = query.strides();
  const float* kn = key.data_ptr<float>();
  const float* vn = value.data_ptr<float>();
  for (size_t i = 0; i < n_rows; ++i) {
    const torch::Tensor& k = keys[i];
    const torch::Tensor& v = values[i];
    TORCH_CHECK(rows[i] >= 0 && rows[i] < B, "row out of range");
    TORCH_CHECK(k.scalar_type() == torch::kFloat32 && v.scalar_type() == torch::kFloat32 &&
                    k.device().is_cpu() && v.device().is_cpu() && k.is_contiguous() &&
                    v.is_contiguous() && k.dim() == 3 && k.sizes() == v.sizes() &&
                    k.size(0) == Hkv && k.size(2) == D,
                "a session's KV buffers must be contiguous float32 [kv_heads, capacity, "
                "head_dim] on the CPU");
    TORCH_CHECK(lengths[i] >= 1 && lengths[i] <= T && starts[i] >= 0 &&
                    starts[i] + lengths[i] <= k.size(1),
                "a session's block must fit its buffers");
    kp[i] = k.data_ptr<float>();
    vp[i] = v.data_ptr<float>();
    cap[i] = k.size(1);
    const int64_t b = rows[i];
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t j = 0; j < lengths[i]; ++j) {
        std::memcpy(kp[i] + (h * cap[i] + starts[i] + j) * D,
                    kn + b * ks[0] + h * ks[1] + j * ks[2], D * sizeof(float));
        std::memcpy(vp[i] + (h * cap[i] + starts[i] + j) * D,
                    vn + b * vs[0] + h * vs[1] + j * vs[2], D * sizeof(float));
      }
  }
  const float* q = query.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t group = H / Hkv;
  const float sc = static_cast<float>(scale);
  const int64_t qs0 = qs[0], qs1 = qs[1], qs2 = qs[2];
  auto run = [&](auto head_dim) {
    constexpr int64_t DD = decltype(head_dim)::value;  // 0: D known only at run time
    const int64_t Dn = DD ? DD : D;
    at::parallel_for(0, static_cast<int64_t>(n_rows) * H, 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> p;
      std::vector<float> acc(Dn);
      for (int64_t unit = lo; unit < hi; ++unit) {
        const int64_t i = unit / H, h = unit % H, b = rows[i];
        const float* K = kp[i] + (h / group) * cap[i] * Dn;
        const float* V = vp[i] + (h / group) * cap[i] * Dn;
        for (int64_t j = 0; j < lengths[i]; ++j) {
          const float* qq = q + b * qs0 + h * qs1 + j * qs2;
          const int64_t n = starts[i] + j + 1;  // keys this query sees
          p.resize(n);
          float* pp = p.data();
          for (int64_t t = 0; t < n; ++t) {
            const float* kk = K + t * Dn;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < Dn; ++d) s += qq[d] * kk[d];
            pp[t] = s * sc;
          }
          float m = -INFINITY;
#pragma omp simd reduction(max : m)
          for (int64_t t = 0; t < n; ++t) m = std::max(m, pp[t]);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < n; ++t) {
            pp[t] = exp_nonpositive(pp[t] - m);
            sum += pp[t];
          }
          float* a = acc.data();
          std::fill(a, a + Dn, 0.f);
          for (int64_t t = 0; t < n; ++t) {
            const float w = pp[t];
            const float* vv = V + t * Dn;
#pragma omp simd
            for (int64_t d = 0; d < Dn; ++d) a[d] += w * vv[d];
          }
          float* oo = o + ((b * T + j) * H + h) * Dn;
          const float inv = 1.f / sum;
          for (int64_t d = 0; d < Dn; ++d) oo[d] = a[d] * inv;
        }
      }
    });
  };
  if (D == 64)
    run(std::integral_constant<int64_t, 64>());
  else if (D == 128)
    run(std::integral_constant<int64_t, 128>());
  else
    run(std::integral_constant<int64_t, 0>());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "attention of short blocks over each session's own KV buffers");
}
