// Attention of query tokens over a KV store, for grouped-query models, reading each KV head
// once per token.
//
// The store holds keys and values by slot: k[s, g] and v[s, g] for slot s and KV head g.
// Token n attends to the L = lengths[n] slots starting at starts[n] (its sequence's
// region: its own key and all before it):
//
//   out[n, h] = sum_t p[n, h, t] * v[starts[n] + t, h / G],
//   p = softmax_t(scale * q[n, h] . k[starts[n] + t, h / G]),   t < L, G = H / KV.
//
// A decode step is one token per sequence; a prefill is a sequence's new tokens, each with
// its own length (causal by construction). Nothing is padded or masked.
//
// Work is split over (token, KV head): each task streams its keys once for the G query
// heads that share them (G dot products per key row), then its values once, in tiles that
// stay in L1 while the G heads' sums pass over them. With AVX2 and FMA, head dims 64 and 128
// and up to 8 query heads per KV head take the intrinsics path below; anything else a plain
// loop the compiler vectorizes. The store is fp32 or bf16 (keys and values widened to fp32
// as they are read: shifted 16 bits left; all arithmetic is fp32 either way). Built by
// tidal.engine.decode_attention (-O3 -march=native -ffast-math: the exponentials are
// glibc's vector expf).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TIDAL_AVX2 1
#endif

namespace {

constexpr float kMasked = -1e30f;  // the running max's start (no infinities under fast-math)
constexpr int64_t kTile = 64;      // value rows per tile (64 x 128 floats: 32 KB)

// A bf16 store's element: the high half of an fp32.
using bf16 = uint16_t;

inline float widen(float x) { return x; }
inline float widen(bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// One (token, KV head): its G queries, its T keys and values (row strides kst, vst, in
// elements of the store's type KT: float or bf16).
template <typename KT>
struct Head {
  const float* q;
  const KT* k;
  const KT* v;
  int64_t kst, vst;
  int64_t T, G, D;
  float scale;
};

// s[i * T + t] = exp(s - max_i) and tot[i] = their sum, for scores s already written.
template <typename KT>
void softmax_rows(const Head<KT>& h, float* s, const float* mx, float* tot) {
  for (int64_t i = 0; i < h.G; ++i) {
    float* si = s + i * h.T;
    const float top = mx[i];
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < h.T; ++t) {
      const float e = expf(si[t] - top);
      si[t] = e;
      sum += e;
    }
    tot[i] = sum;
  }
}

// The portable path: any head dim, any group size.
template <typename KT>
void plain_head(const Head<KT>& h, float* s, float* acc, float* mx, float* tot) {
  const int64_t G = h.G, D = h.D, T = h.T;
  std::fill(mx, mx + G, kMasked);
  for (int64_t t = 0; t < T; ++t) {
    const KT* kt = h.k + t * h.kst;
    for (int64_t i = 0; i < G; ++i) {
      const float* qi = h.q + i * D;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t j = 0; j < D; ++j) dot += qi[j] * widen(kt[j]);
      const float x = h.scale * dot;
      s[i * T + t] = x;
      mx[i] = std::max(mx[i], x);
    }
  }
  softmax_rows(h, s, mx, tot);
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t t = 0; t < T; ++t) {
    const KT* vt = h.v + t * h.vst;
    for (int64_t i = 0; i < G; ++i) {
      const float p = s[i * T + t];
      float* a = acc + i * D;
#pragma omp simd
      for (int64_t j = 0; j < D; ++j) a[j] += p * widen(vt[j]);
    }
  }
}

#ifdef TIDAL_AVX2
inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// 8 elements of a row as 8 floats.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// Rows stream from memory faster when every cache line is asked for ahead of its use: the
// hardware prefetcher alone left the passes at about half the machine's read rate.
constexpr int64_t kAhead = 16;  // key rows
template <typename KT>
inline void prefetch_rows(const KT* row, int64_t stride, int64_t rows, int64_t D) {
  constexpr int64_t line = 64 / sizeof(KT);  // elements per cache line
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < D; j += line) {
      _mm_prefetch(reinterpret_cast<const char*>(row + r * stride + j), _MM_HINT_T0);
    }
  }
}

// Head dim D (a multiple of 16), G query heads (1..8) on one KV head.
template <int D, int G, typename KT>
void avx2_head(const Head<KT>& h, float* s, float* acc, float* mx, float* tot) {
  constexpr int C = D / 8;  // 8-float chunks of a row
  const int64_t T = h.T;
  std::fill(mx, mx + G, kMasked);
  // scores: each key row loaded once, G dot products from it; four rows at a time, their
  // sums reduced together (one horizontal add tree for four dot products)
  int64_t t = 0;
  for (; t + 4 <= T; t += 4) {
    const KT* k0 = h.k + t * h.kst;
    prefetch_rows(k0 + kAhead * h.kst, h.kst, 4, D);
    for (int i = 0; i < G; ++i) {
      const float* qi = h.q + i * D;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int c = 0; c < C; ++c) {
        const __m256 qv = _mm256_loadu_ps(qi + 8 * c);
        a0 = _mm256_fmadd_ps(qv, load8(k0 + 8 * c), a0);
        a1 = _mm256_fmadd_ps(qv, load8(k0 + h.kst + 8 * c), a1);
        a2 = _mm256_fmadd_ps(qv, load8(k0 + 2 * h.kst + 8 * c), a2);
        a3 = _mm256_fmadd_ps(qv, load8(k0 + 3 * h.kst + 8 * c), a3);
      }
      // [a0 a1 a2 a3] -> their four sums
      const __m256 h01 = _mm256_hadd_ps(a0, a1), h23 = _mm256_hadd_ps(a2, a3);
      const __m256 h0123 = _mm256_hadd_ps(h01, h23);
      __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h0123), _mm256_extractf128_ps(h0123, 1));
      sums = _mm_mul_ps(sums, _mm_set1_ps(h.scale));
      alignas(16) float out4[4];
      _mm_store_ps(out4, sums);
      float* si = s + i * T + t;
      float m = mx[i];
      for (int r = 0; r < 4; ++r) {
        si[r] = out4[r];
        m = std::max(m, out4[r]);
      }
      mx[i] = m;
    }
  }
  for (; t < T; ++t) {
    const KT* kt = h.k + t * h.kst;
    for (int i = 0; i < G; ++i) {
      __m256 a = _mm256_setzero_ps();
      for (int c = 0; c < C; ++c) {
        a = _mm256_fmadd_ps(_mm256_loadu_ps(h.q + i * D + 8 * c), load8(kt + 8 * c), a);
      }
      const float x = h.scale * hsum(a);
      s[i * T + t] = x;
      mx[i] = std::max(mx[i], x);
    }
  }
  softmax_rows(h, s, mx, tot);
  // values: tile by tile (L1), two chunks of the head dim at a time for all G heads
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t t0 = 0; t0 < T; t0 += kTile) {
    const int64_t t1 = std::min(T, t0 + kTile);
    for (int c = 0; c < C; c += 2) {
      __m256 a0[G], a1[G];
      for (int i = 0; i < G; ++i) {
        a0[i] = _mm256_loadu_ps(acc + i * D + 8 * c);
        a1[i] = _mm256_loadu_ps(acc + i * D + 8 * c + 8);
      }
      for (int64_t t = t0; t < t1; ++t) {
        if (c == 0) prefetch_rows(h.v + (t + kTile) * h.vst, h.vst, 1, D);  // the next tile's
        const KT* vt = h.v + t * h.vst + 8 * c;
        const __m256 v0 = load8(vt), v1 = load8(vt + 8);
        for (int i = 0; i < G; ++i) {
          const __m256 p = _mm256_broadcast_ss(s + i * T + t);
          a0[i] = _mm256_fmadd_ps(p, v0, a0[i]);
          a1[i] = _mm256_fmadd_ps(p, v1, a1[i]);
        }
      }
      for (int i = 0; i < G; ++i) {
        _mm256_storeu_ps(acc + i * D + 8 * c, a0[i]);
        _mm256_storeu_ps(acc + i * D + 8 * c + 8, a1[i]);
      }
    }
  }
}

template <int D, typename KT>
bool avx2_group(const Head<KT>& h, float* s, float* acc, float* mx, float* tot) {
  switch (h.G) {
    case 1: avx2_head<D, 1>(h, s, acc, mx, tot); return true;
    case 2: avx2_head<D, 2>(h, s, acc, mx, tot); return true;
    case 3: avx2_head<D, 3>(h, s, acc, mx, tot); return true;
    case 4: avx2_head<D, 4>(h, s, acc, mx, tot); return true;
    case 5: avx2_head<D, 5>(h, s, acc, mx, tot); return true;
    case 6: avx2_head<D, 6>(h, s, acc, mx, tot); return true;
    case 7: avx2_head<D, 7>(h, s, acc, mx, tot); return true;
    case 8: avx2_head<D, 8>(h, s, acc, mx, tot); return true;
    default: return false;
  }
}
#endif

// The intrinsics path where it applies (returns false: use plain_head).
template <typename KT>
bool fast_head(const Head<KT>& h, float* s, float* acc, float* mx, float* tot) {
#ifdef TIDAL_AVX2
  if (h.D == 64) return avx2_group<64>(h, s, acc, mx, tot);
  if (h.D == 128) return avx2_group<128>(h, s, acc, mx, tot);
#endif
  (void)h; (void)s; (void)acc; (void)mx; (void)tot;
  return false;
}

// out [N, H, D] for queries qp over a store of KT (see decode_attention).
template <typename KT>
void attend(const float* qp, const KT* kp, const KT* vp, float* op, const int64_t* sp,
            const int64_t* lp, int64_t N, int64_t H, int64_t KV, int64_t D, int64_t longest,
            int64_t kss, int64_t ksh, int64_t vss, int64_t vsh, float sc) {
  const int64_t G = H / KV;
  at::parallel_for(0, N * KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(G * longest), acc(G * D), mx(G), tot(G);
    for (int64_t ng = begin; ng < end; ++ng) {
      const int64_t n = ng / KV, g = ng % KV;
      Head<KT> h{qp + (n * H + g * G) * D, kp + sp[n] * kss + g * ksh,
                 vp + sp[n] * vss + g * vsh, kss, vss, lp[n], G, D, sc};
      if (!fast_head(h, s.data(), acc.data(), mx.data(), tot.data())) {
        plain_head(h, s.data(), acc.data(), mx.data(), tot.data());
      }
      for (int64_t i = 0; i < G; ++i) {
        float* o = op + (n * H + g * G + i) * D;
        const float inv = 1.f / tot[i];
        for (int64_t j = 0; j < D; ++j) o[j] = acc[i * D + j] * inv;
      }
    }
  });
}

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const torch::Tensor& starts,
                               const torch::Tensor& lengths, double scale) {
  const bool half = k.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 &&
                  (k.scalar_type() == torch::kFloat32 || half) &&
                  v.scalar_type() == k.scalar_type(),
              "decode_attention: q float32, k and v both float32 or both bfloat16");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3,
              "decode_attention: q is [N, H, D], k and v [S, KV, D]");
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t S = k.size(0), KV = k.size(1);
  TORCH_CHECK(KV > 0 && H % KV == 0, "decode_attention: H must be a multiple of KV");
  TORCH_CHECK(v.size(0) == S && v.size(1) == KV && k.size(2) == D && v.size(2) == D,
              "decode_attention: k and v must be [S, KV, D] for q [N, H, D]");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1,
              "decode_attention: k and v need contiguous head dims");
  TORCH_CHECK(starts.scalar_type() == torch::kLong && lengths.scalar_type() == torch::kLong &&
                  starts.dim() == 1 && lengths.dim() == 1 && starts.size(0) == N &&
                  lengths.size(0) == N,
              "decode_attention: starts and lengths must be int64 [N]");
  const torch::Tensor st = starts.contiguous(), ln = lengths.contiguous();
  const int64_t* sp = st.data_ptr<int64_t>();
  const int64_t* lp = ln.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(lp[n] > 0 && sp[n] >= 0 && sp[n] + lp[n] <= S,
                "decode_attention: token ", n, " reads slots [", sp[n], ", ", sp[n] + lp[n],
                ") of a store of ", S);
    longest = std::max(longest, lp[n]);
  }
  const torch::Tensor qc = q.contiguous();
  torch::Tensor out = torch::empty({N, H, D}, q.options());
  const float sc = static_cast<float>(scale);
  if (half) {
    attend(qc.data_ptr<float>(), reinterpret_cast<const bf16*>(k.data_ptr<at::BFloat16>()),
           reinterpret_cast<const bf16*>(v.data_ptr<at::BFloat16>()), out.data_ptr<float>(),
           sp, lp, N, H, KV, D, longest, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
           sc);
  } else {
    attend(qc.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
           out.data_ptr<float>(), sp, lp, N, H, KV, D, longest, k.stride(0), k.stride(1),
           v.stride(0), v.stride(1), sc);
  }
  return out;
}

// ---- the decode step's small ops, each one pass instead of several torch ops --------------
//
// At 16 rows these are tiny ([16, 576] and the like): through torch each is several kernels
// (F.rms_norm on CPU is pow, mean, add, rsqrt, mul, mul), each with its dispatch and
// allocation. Rows run in parallel where there are enough of them; the sums are fp32 in
// another order than torch's (float noise, as the attention's).

// y[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w, for the rows of x [N, C]; with `delta`, x is
// first updated in place: x += delta (the residual add before the norm).
void norm_rows(float* x, const float* delta, const float* w, float* y, int64_t N, int64_t C,
               float eps) {
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = x + r * C;
      if (delta) {
        const float* dr = delta + r * C;
#pragma omp simd
        for (int64_t j = 0; j < C; ++j) xr[j] += dr[j];
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < C; ++j) ss += xr[j] * xr[j];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(C) + eps);
      float* yr = y + r * C;
#pragma omp simd
      for (int64_t j = 0; j < C; ++j) yr[j] = w[j] * (xr[j] * inv);
    }
  });
}

void check_rows(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
              what, ": a contiguous float32 [N, C] tensor");
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_rows(x, "rms_norm: x");
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.dim() == 1 && w.is_contiguous() &&
                  w.size(0) == x.size(1),
              "rms_norm: the weight must be a contiguous float32 [C]");
  torch::Tensor y = torch::empty_like(x);
  // the input is only read without a delta
  norm_rows(const_cast<float*>(x.data_ptr<float>()), nullptr, w.data_ptr<float>(),
            y.data_ptr<float>(), x.size(0), x.size(1), static_cast<float>(eps));
  return y;
}

torch::Tensor add_rms_norm(torch::Tensor x, const torch::Tensor& delta, const torch::Tensor& w,
                           double eps) {
  check_rows(x, "add_rms_norm: x");
  check_rows(delta, "add_rms_norm: delta");
  TORCH_CHECK(delta.sizes() == x.sizes(), "add_rms_norm: delta must have x's shape");
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.dim() == 1 && w.is_contiguous() &&
                  w.size(0) == x.size(1),
              "add_rms_norm: the weight must be a contiguous float32 [C]");
  torch::Tensor y = torch::empty_like(x);
  norm_rows(x.data_ptr<float>(), delta.data_ptr<float>(), w.data_ptr<float>(),
            y.data_ptr<float>(), x.size(0), x.size(1), static_cast<float>(eps));
  return y;
}

// The fused q/k/v projection's output [B, (H + 2 KV) D] split into q [B, H, D] and k, v
// [B, KV, 1, D], rotary applied to q and k (transformers' rotate-half form: cos and sin
// [B, D], their two halves equal).
std::vector<torch::Tensor> rope_split(const torch::Tensor& qkv, const torch::Tensor& cos,
                                      const torch::Tensor& sin, int64_t H, int64_t KV) {
  check_rows(qkv, "rope_split: qkv");
  check_rows(cos, "rope_split: cos");
  check_rows(sin, "rope_split: sin");
  const int64_t B = qkv.size(0), D = cos.size(1), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && cos.size(0) == B && sin.sizes() == cos.sizes(),
              "rope_split: cos and sin must be [B, D] with D even");
  TORCH_CHECK(qkv.size(1) == (H + 2 * KV) * D, "rope_split: qkv must be [B, (H + 2 KV) D]");
  torch::Tensor q = torch::empty({B, H, D}, qkv.options());
  torch::Tensor k = torch::empty({B, KV, D}, qkv.options());
  torch::Tensor v = torch::empty({B, KV, D}, qkv.options());
  const float* src = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  const int64_t W = qkv.size(1);
  for (int64_t b = 0; b < B; ++b) {
    const float* row = src + b * W;
    const float* c = cp + b * D;
    const float* s = sp + b * D;
    for (int64_t hd = 0; hd < H + KV; ++hd) {
      const float* x = row + hd * D;
      float* o = hd < H ? qp + (b * H + hd) * D : kp + (b * KV + hd - H) * D;
#pragma omp simd
      for (int64_t j = 0; j < half; ++j) {
        o[j] = x[j] * c[j] - x[j + half] * s[j];
        o[j + half] = x[j + half] * c[j + half] + x[j] * s[j + half];
      }
    }
    std::copy(row + (H + KV) * D, row + W, vp + b * KV * D);
  }
  return {q, k, v};
}

// silu(gu[:, :I]) * gu[:, I:] for the fused gate/up projection's output [B, 2 I].
torch::Tensor silu_mul(const torch::Tensor& gu) {
  check_rows(gu, "silu_mul: gu");
  TORCH_CHECK(gu.size(1) % 2 == 0, "silu_mul: gu must be [B, 2 I]");
  const int64_t B = gu.size(0), I = gu.size(1) / 2;
  torch::Tensor out = torch::empty({B, I}, gu.options());
  const float* g = gu.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, B, 4, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* gate = g + b * 2 * I;
      const float* up = gate + I;
      float* ob = o + b * I;
#pragma omp simd
      for (int64_t j = 0; j < I; ++j) ob[j] = gate[j] / (1.f + expf(-gate[j])) * up[j];
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "grouped-query attention over a KV store (see the file)");
  m.def("rms_norm", &rms_norm, "x * rsqrt(mean(x^2) + eps) * w over rows");
  m.def("add_rms_norm", &add_rms_norm, "x += delta in place, then rms_norm(x)");
  m.def("rope_split", &rope_split, "q, k, v of a fused projection, rotary on q and k");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate/up projection");
}
