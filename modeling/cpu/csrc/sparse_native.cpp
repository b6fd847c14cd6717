// swapformer's native fp32 CPU kernels for the sparse backend (modeling/sparse_native.py builds and calls them).
//
// band_attention: each query block attends to its band of keys and to the global keys in ONE softmax per
// row: the band's scores come from one oneDNN brgemm call (AVX-512 code where the CPU has it, unlike the
// MKL sgemm behind torch's CPU flash kernel, which runs AVX2 code on AMD processors), the global keys'
// scores and values are a few vector FMAs per row on data already in cache, so they cost their FLOPs
// and no extra pass over memory.
// global_rows: the rows of the global queries over every key, in chunks of keys with an online softmax.
//
// Shapes: B batch, H query heads, K kv heads (G = H / K), N query blocks of b rows, L band keys,
// Gk global keys (Gp: Gk rounded up to a multiple of 16, the widest vector), S keys, D head dim, R global query rows.
// Masks are additive (0 or -inf, or a bias); a row that sees no key at all gets zeros.

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
namespace blas = at::native::cpublas;
constexpr int64_t kW = Vec::size();
constexpr float kNeg = -std::numeric_limits<float>::infinity();
constexpr int64_t kRows = 64;  // query rows per brgemm call (a 64 x 336 score tile stays in L2)
constexpr int64_t kKeys = 256;  // keys per step of global_rows

void check(const at::Tensor& t, int64_t dim, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions, got ", t.dim());
  // A last dimension of size 0 or 1 is read at offset 0 only, so its stride does not matter (torch calls
  // such a tensor contiguous whatever that stride is, and a mask one key wide arrives with any).
  TORCH_CHECK(t.size(dim - 1) <= 1 || t.stride(dim - 1) == 1, name, "'s last dimension must be contiguous");
}

// scale * row + mask over `n` columns, in place; returns the row's maximum.
float scale_mask_max(float* row, const float* mask, int64_t n, float scale) {
  const Vec vs(scale);
  Vec vmax(kNeg);
  int64_t j = 0;
  for (; j + kW <= n; j += kW) {
    const Vec x = at::vec::fmadd(Vec::loadu(row + j), vs, Vec::loadu(mask + j));
    x.store(row + j);
    vmax = at::vec::maximum(vmax, x);
  }
  float mx = vmax.reduce_max();
  for (; j < n; ++j) {
    row[j] = row[j] * scale + mask[j];
    mx = std::max(mx, row[j]);
  }
  return mx;
}

// exp(row - mx) over `n` columns, in place; returns their sum (mx must be finite).
float exp_sum(float* row, int64_t n, float mx) {
  const Vec vm(mx);
  Vec vsum(0.f);
  int64_t j = 0;
  for (; j + kW <= n; j += kW) {
    const Vec e = (Vec::loadu(row + j) - vm).exp_u20();
    e.store(row + j);
    vsum = vsum + e;
  }
  float sum = vsum.reduce_add();
  for (; j < n; ++j) {
    row[j] = std::exp(row[j] - mx);
    sum += row[j];
  }
  return sum;
}

// Scores of `rows` query rows (row stride qs) against the global keys kg (D x Gp, pre-scaled), written
// to s + C with row stride ld: four rows at a time, sixteen keys per vector.
void global_scores(const float* q, int64_t qs, int64_t rows, const float* kg, int64_t D, int64_t Gp, float* s,
                   int64_t ld) {
  for (int64_t i = 0; i < rows; i += 4) {
    const int64_t r = std::min<int64_t>(4, rows - i);
    const float* q0 = q + i * qs;
    const float* q1 = r > 1 ? q0 + qs : q0;
    const float* q2 = r > 2 ? q0 + 2 * qs : q0;
    const float* q3 = r > 3 ? q0 + 3 * qs : q0;
    for (int64_t t = 0; t < Gp; t += kW) {
      Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
      for (int64_t d = 0; d < D; ++d) {
        const Vec k = Vec::loadu(kg + d * Gp + t);
        a0 = at::vec::fmadd(Vec(q0[d]), k, a0);
        a1 = at::vec::fmadd(Vec(q1[d]), k, a1);
        a2 = at::vec::fmadd(Vec(q2[d]), k, a2);
        a3 = at::vec::fmadd(Vec(q3[d]), k, a3);
      }
      float* dst = s + i * ld + t;
      a0.store(dst);
      if (r > 1) a1.store(dst + ld);
      if (r > 2) a2.store(dst + 2 * ld);
      if (r > 3) a3.store(dst + 3 * ld);
    }
  }
}

}  // namespace

// q (B,H,N*b,D); kt (B,K,D,S) the keys transposed (any row stride); v (B,K,S,D); mask (B,N,1|H,b,L);
// band_start: key index of block 0's first band key (may be negative; keys outside 0..S-1 are skipped);
// kgt (B,K,D,Gp) the global keys transposed, multiplied by `scale`, zero-padded; vg (B,K,Gk,D); gmask
// (B,N,1|H,b,Gk) (kgt, vg, gmask empty when there are no global keys; gmask may be empty alone);
// out (B,N*b,H,D), contiguous, written.
void band_attention(const at::Tensor& q, const at::Tensor& kt, const at::Tensor& v, const at::Tensor& mask,
                    int64_t band_start, const at::Tensor& kgt, const at::Tensor& vg, const at::Tensor& gmask,
                    double scale, const at::Tensor& out) {
  check(q, 4, "q"), check(kt, 4, "kt"), check(v, 4, "v"), check(mask, 5, "mask"), check(out, 4, "out");
  TORCH_CHECK(out.is_contiguous(), "out must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), K = kt.size(1), S = kt.size(3);
  const int64_t N = mask.size(1), Mh = mask.size(2), b = mask.size(3), L = mask.size(4);
  TORCH_CHECK(H % K == 0 && (Mh == 1 || Mh == H) && q.size(2) == N * b && out.size(1) == N * b,
              "band_attention: inconsistent shapes");
  const int64_t G = H / K;
  const int64_t Gk = vg.numel() ? vg.size(2) : 0, Gp = Gk ? kgt.size(3) : 0;
  if (Gk) check(kgt, 4, "kgt"), check(vg, 4, "vg");
  TORCH_CHECK(!Gk || (kgt.is_contiguous() && vg.is_contiguous() && Gp >= Gk && Gp % kW == 0),
              "kgt must be (B, K, D, Gp), Gp >= Gk a multiple of ", kW, ", and vg (B, K, Gk, D), contiguous");
  const bool gm = gmask.numel() > 0;
  if (gm) check(gmask, 5, "gmask");
  const int64_t Gh = gm ? gmask.size(2) : 1;
  const int64_t rows_max = std::min(b, kRows), ld = (L + Gp + kW - 1) / kW * kW;
  const float* qp = q.data_ptr<float>();
  const float* ktp = kt.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* mp = mask.data_ptr<float>();
  const float* kgp = Gk ? kgt.data_ptr<float>() : nullptr;
  const float* vgp = Gk ? vg.data_ptr<float>() : nullptr;
  const float* gmp = gm ? gmask.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const auto qs = q.strides(), kts = kt.strides(), vs = v.strides(), ms = mask.strides();
  const std::vector<int64_t> gms = gm ? gmask.strides().vec() : std::vector<int64_t>(5, 0);
  const int64_t os = H * D;
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, B * K * N, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(rows_max * ld), sums(rows_max);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task % N, kh = (task / N) % K, bi = task / (N * K);
      const int64_t lo = band_start + n * b;
      const int64_t lo_c = std::clamp<int64_t>(lo, 0, S), hi_c = std::clamp<int64_t>(lo + L, 0, S);
      const int64_t C = std::max<int64_t>(hi_c - lo_c, 0), off = lo_c - lo, C2 = C + Gk;
      const float* ktb = ktp + bi * kts[0] + kh * kts[1] + lo_c;
      const float* vb = vp + bi * vs[0] + kh * vs[1] + lo_c * vs[2];
      const float* kg = Gk ? kgp + (bi * K + kh) * D * Gp : nullptr;
      const float* vgb = Gk ? vgp + (bi * K + kh) * Gk * D : nullptr;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = kh * G + g;
        for (int64_t r0 = 0; r0 < b; r0 += rows_max) {
          const int64_t rows = std::min(rows_max, b - r0);
          const float* qb = qp + bi * qs[0] + h * qs[1] + (n * b + r0) * qs[2];
          float* s = buf.data();
          if (C > 0) blas::brgemm(rows, C, D, qs[2], kts[2], ld, false, qb, ktb, s, false);
          if (Gk) global_scores(qb, qs[2], rows, kg, D, Gp, s + C, ld);
          const float* mrow = mp + bi * ms[0] + n * ms[1] + (Mh == 1 ? 0 : h) * ms[2] + r0 * ms[3] + off;
          const float* grow = gm ? gmp + bi * gms[0] + n * gms[1] + (Gh == 1 ? 0 : h) * gms[2] + r0 * gms[3] : nullptr;
          for (int64_t i = 0; i < rows; ++i) {
            float* row = s + i * ld;
            float mx = scale_mask_max(row, mrow + i * ms[3], C, fscale);
            for (int64_t j = 0; j < Gk; ++j) {
              if (grow) row[C + j] += grow[i * gms[3] + j];
              mx = std::max(mx, row[C + j]);
            }
            if (mx == kNeg) {  // no key for this row: zeros (its output becomes 0)
              std::fill(row, row + C2, 0.f);
              sums[i] = 0.f;
            } else {
              sums[i] = exp_sum(row, C2, mx);
            }
          }
          float* ob = op + bi * N * b * os + (n * b + r0) * os + h * D;
          if (C > 0) blas::brgemm(rows, D, C, ld, vs[2], os, false, s, vb, ob, false);
          for (int64_t i = 0; i < rows; ++i) {  // the global keys' values, then 1 / sum
            float* o = ob + i * os;
            const float* p = s + i * ld + C;
            const Vec inv(sums[i] > 0.f ? 1.f / sums[i] : 0.f);
            for (int64_t d0 = 0; d0 < D; d0 += kW) {
              const int64_t cnt = std::min<int64_t>(kW, D - d0);
              Vec acc = C > 0 ? Vec::loadu(o + d0, cnt) : Vec(0.f);
              for (int64_t j = 0; j < Gk; ++j) acc = at::vec::fmadd(Vec(p[j]), Vec::loadu(vgb + j * D + d0, cnt), acc);
              (acc * inv).store(o + d0, cnt);
            }
          }
        }
      }
    }
    blas::brgemm_release(false);
  });
}

// q (B,H,R,D) the global query rows; kt (B,K,D,S); v (B,K,S,D); mask (B,1|H,R,S) or empty; out (B,R,H,D),
// contiguous, written.
void global_rows(const at::Tensor& q, const at::Tensor& kt, const at::Tensor& v, const at::Tensor& mask,
                 double scale, const at::Tensor& out) {
  check(q, 4, "q"), check(kt, 4, "kt"), check(v, 4, "v"), check(out, 4, "out");
  TORCH_CHECK(out.is_contiguous(), "out must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3), K = kt.size(1), S = kt.size(3);
  const bool masked = mask.numel() > 0;
  if (masked) check(mask, 4, "mask");
  const int64_t Mh = masked ? mask.size(1) : 1, G = H / K;
  const float* qp = q.data_ptr<float>();
  const float* ktp = kt.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* mp = masked ? mask.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const auto qs = q.strides(), kts = kt.strides(), vs = v.strides();
  const std::vector<int64_t> ms = masked ? mask.strides().vec() : std::vector<int64_t>(4, 0);
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(R * kKeys), acc(R * D), top(R), total(R), zeros(kKeys, 0.f);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task % H, bi = task / H, kh = h / G;
      const float* qb = qp + bi * qs[0] + h * qs[1];
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(top.begin(), top.end(), kNeg);
      std::fill(total.begin(), total.end(), 0.f);
      for (int64_t c0 = 0; c0 < S; c0 += kKeys) {
        const int64_t c = std::min(kKeys, S - c0);
        blas::brgemm(R, c, D, qs[2], kts[2], kKeys, false, qb, ktp + bi * kts[0] + kh * kts[1] + c0, s.data(), false);
        for (int64_t i = 0; i < R; ++i) {
          float* row = s.data() + i * kKeys;
          const float* mrow = masked ? mp + bi * ms[0] + (Mh == 1 ? 0 : h) * ms[1] + i * ms[2] + c0 : zeros.data();
          const float mx = std::max(top[i], scale_mask_max(row, mrow, c, fscale));
          if (mx == kNeg) {  // nothing seen yet: this chunk adds nothing
            std::fill(row, row + c, 0.f);
            continue;
          }
          const float shrink = std::exp(top[i] - mx);  // 0 while top is -inf
          if (shrink != 1.f) {
            float* a = acc.data() + i * D;
            for (int64_t d = 0; d < D; ++d) a[d] *= shrink;
          }
          total[i] = total[i] * shrink + exp_sum(row, c, mx);
          top[i] = mx;
        }
        blas::brgemm(R, D, c, kKeys, vs[2], D, true, s.data(), vp + bi * vs[0] + kh * vs[1] + c0 * vs[2], acc.data(), false);
      }
      for (int64_t i = 0; i < R; ++i) {
        float* o = op + ((bi * R + i) * H + h) * D;
        const float inv = total[i] > 0.f ? 1.f / total[i] : 0.f;
        for (int64_t d = 0; d < D; ++d) o[d] = acc[i * D + d] * inv;
      }
    }
    blas::brgemm_release(false);
  });
}

TORCH_LIBRARY(swapformer_sparse_native, m) {
  m.def("band_attention(Tensor q, Tensor kt, Tensor v, Tensor mask, int band_start, Tensor kgt, Tensor vg, "
        "Tensor gmask, float scale, Tensor(a!) out) -> ()");
  m.def("global_rows(Tensor q, Tensor kt, Tensor v, Tensor mask, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(swapformer_sparse_native, CPU, m) {
  m.impl("band_attention", band_attention);
  m.impl("global_rows", global_rows);
}
