// The model's elementwise kernels for CPU, one pass over memory each, with the rounding of the
// pure-torch references (kubeinfer.kernels.*_reference): what those round to the tensor's dtype
// between ops is rounded here at the same points, so float32 results are the references' bit for
// bit up to exp's last place, and bfloat16/float16 ones within the references' own rounding.
//
//   rms_norm(out, x, weight, eps):       out = w * dtype(x * rsqrt(mean(x^2) + eps))
//   silu_and_mul(out, x):                out = dtype(silu(gate)) * up, x = [gate | up]
//   rotary_neox(positions, q, k, cache): in place, y1 = x1 c - x2 s, y2 = x2 c + x1 s
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "common.h"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

using kubeinfer_cpu::fast_exp;

// float -> bfloat16 bits, round to nearest even, vectorizable (c10's conversion branches on NaN,
// which keeps loops scalar); a NaN stays a NaN.
inline uint32_t bf16_round_bits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  const uint32_t r = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
  return v != v ? (b | 0x00400000u) & 0xFFFF0000u : r;
}

template <typename T>
inline float from_t(T v) {
  return static_cast<float>(v);
}

template <>
inline float from_t<c10::BFloat16>(c10::BFloat16 v) {
  const uint32_t b = static_cast<uint32_t>(v.x) << 16;
  float r;
  std::memcpy(&r, &b, sizeof r);
  return r;
}

template <typename T>
inline T to_t(float v) {
  return static_cast<T>(v);
}

template <>
inline c10::BFloat16 to_t<c10::BFloat16>(float v) {
  return c10::BFloat16(static_cast<uint16_t>(bf16_round_bits(v) >> 16), c10::BFloat16::from_bits());
}

template <typename T>
inline float rnd(float v) {  // round to T and back: the reference's rounding between ops
  return static_cast<float>(static_cast<T>(v));
}

template <>
inline float rnd<c10::BFloat16>(float v) {
  const uint32_t b = bf16_round_bits(v);
  float r;
  std::memcpy(&r, &b, sizeof r);
  return r;
}

template <>
inline float rnd<float>(float v) {
  return v;
}

// out = w * (x * inv rounded to T), as transformers' RMSNorm casts before the weight
template <typename T>
inline void scale_row(T* out, const T* x, const T* w, int64_t n, float inv) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = to_t<T>(from_t<T>(w[i]) * rnd<T>(from_t<T>(x[i]) * inv));
}

template <typename T>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * n;
      T* orow = op + r * n;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < n; ++i) {
        const float v = from_t<T>(xr[i]);
        ss += v * v;
      }
      scale_row<T>(orow, xr, wp, n, 1.0f / std::sqrt(ss / static_cast<float>(n) + feps));
    }
  });
}

// residual_out = x + residual (rounded to T, as torch adds), out = rms_norm(residual_out): the
// decoder layer's residual add and the next norm in one pass over the row.
template <typename T>
void rms_norm_add_impl(at::Tensor& out, at::Tensor& residual_out, const at::Tensor& x,
                       const at::Tensor& residual, const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* rp = residual.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  T* sp = residual_out.data_ptr<T>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * n;
      const T* rr = rp + r * n;
      T* srow = sp + r * n;
      T* orow = op + r * n;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < n; ++i) {
        const float v = rnd<T>(from_t<T>(xr[i]) + from_t<T>(rr[i]));
        srow[i] = to_t<T>(v);
        ss += v * v;
      }
      scale_row<T>(orow, srow, wp, n, 1.0f / std::sqrt(ss / static_cast<float>(n) + feps));
    }
  });
}

template <typename T>
void silu_and_mul_impl(at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0), n = out.size(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = xp + r * 2 * n;
      const T* u = g + n;
      T* o = op + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float gv = from_t<T>(g[i]);
        const float s = rnd<T>(gv / (1.0f + fast_exp(-gv)));
        o[i] = to_t<T>(s * from_t<T>(u[i]));
      }
    }
  });
}

template <typename T>
__attribute__((optimize("fp-contract=off"))) void rotate(T* x, const float* cs, int64_t half,
                                                        int64_t cache_half) {
  for (int64_t i = 0; i < half; ++i) {
    const float c = rnd<T>(cs[i]), s = rnd<T>(cs[cache_half + i]);
    const float x1 = from_t<T>(x[i]), x2 = from_t<T>(x[half + i]);
    const float y1 = rnd<T>(rnd<T>(x1 * c) - rnd<T>(x2 * s));
    const float y2 = rnd<T>(rnd<T>(x2 * c) + rnd<T>(x1 * s));
    x[i] = to_t<T>(y1);
    x[half + i] = to_t<T>(y2);
  }
}

template <typename T>
void rotary_impl(const at::Tensor& positions, at::Tensor& q, at::Tensor& k,
                 const at::Tensor& cache) {
  const int64_t T_ = q.size(0), hq = q.size(1), hk = k.size(1);
  const int64_t rot = cache.size(1), half = rot / 2, max_pos = cache.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T_; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "positions[", t, "] = ", pos[t],
                " is outside the rotary cache (", max_pos, " positions)");
  const float* cp = cache.data_ptr<float>();
  T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1);
  at::parallel_for(0, T_, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cs = cp + pos[t] * rot;
      for (int64_t h = 0; h < hq; ++h) rotate<T>(qp + t * qs0 + h * qs1, cs, half, half);
      for (int64_t h = 0; h < hk; ++h) rotate<T>(kp + t * ks0 + h * ks1, cs, half, half);
    }
  });
}

#define KI_DISPATCH(dtype, NAME, ...)                                                   \
  switch (dtype) {                                                                      \
    case at::kFloat: {                                                                  \
      using scalar = float;                                                             \
      __VA_ARGS__;                                                                      \
      break;                                                                            \
    }                                                                                   \
    case at::kBFloat16: {                                                               \
      using scalar = c10::BFloat16;                                                     \
      __VA_ARGS__;                                                                      \
      break;                                                                            \
    }                                                                                   \
    case at::kHalf: {                                                                   \
      using scalar = c10::Half;                                                         \
      __VA_ARGS__;                                                                      \
      break;                                                                            \
    }                                                                                   \
    default:                                                                            \
      TORCH_CHECK(false, NAME, ": float32, bfloat16 or float16, got ", dtype);          \
  }

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(),
              "rms_norm: x must be a contiguous (rows, n) CPU tensor");
  TORCH_CHECK(out.sizes() == x.sizes() && out.is_contiguous() && out.dtype() == x.dtype(),
              "rms_norm: out must be contiguous and like x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.dtype() == x.dtype(),
              "rms_norm: weight must be (n,) of x's dtype");
  KI_DISPATCH(x.scalar_type(), "rms_norm", rms_norm_impl<scalar>(out, x, weight, eps));
}

void rms_norm_add(at::Tensor out, at::Tensor residual_out, const at::Tensor& x,
                  const at::Tensor& residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(),
              "rms_norm: x must be a contiguous (rows, n) CPU tensor");
  const at::Tensor* alike[] = {&residual, &out, &residual_out};
  for (const at::Tensor* t : alike)
    TORCH_CHECK(t->sizes() == x.sizes() && t->is_contiguous() && t->dtype() == x.dtype(),
                "rms_norm: residual, out and residual_out must be contiguous and like x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.dtype() == x.dtype(),
              "rms_norm: weight must be (n,) of x's dtype");
  KI_DISPATCH(x.scalar_type(), "rms_norm",
              rms_norm_add_impl<scalar>(out, residual_out, x, residual, weight, eps));
}

void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0,
              "silu_and_mul: x must be a contiguous (rows, 2I) CPU tensor");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) * 2 == x.size(1) &&
                  out.is_contiguous() && out.dtype() == x.dtype(),
              "silu_and_mul: out must be a contiguous (rows, I) tensor of x's dtype");
  KI_DISPATCH(x.scalar_type(), "silu_and_mul", silu_and_mul_impl<scalar>(out, x));
}

void rotary_neox(const at::Tensor& positions, at::Tensor q, at::Tensor k,
                 const at::Tensor& cache) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 &&
                  positions.is_contiguous() && positions.size(0) == q.size(0),
              "rotary: positions must be (T,) int64");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.size(0) == q.size(0) && k.size(2) == q.size(2) &&
                  q.stride(2) == 1 && k.stride(2) == 1 && q.dtype() == k.dtype(),
              "rotary: q (T, H, D) and k (T, Hkv, D) of one dtype, contiguous heads");
  TORCH_CHECK(cache.scalar_type() == at::kFloat && cache.dim() == 2 && cache.is_contiguous() &&
                  cache.size(1) % 2 == 0 && cache.size(1) <= q.size(2),
              "rotary: cos_sin_cache must be contiguous float32 (max_positions, rot_dim)");
  KI_DISPATCH(q.scalar_type(), "rotary", rotary_impl<scalar>(positions, q, k, cache));
}

void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.device().is_cpu() && k.dim() == 3 && v.sizes() == k.sizes() &&
                  k.dtype() == v.dtype(),
              "store_kv: k and v must be (T, Hkv, D) CPU tensors alike");
  const int64_t T = k.size(0), row = k.size(1) * k.size(2);
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) == k.size(2) &&
                  v.stride(1) == v.size(2),
              "store_kv: each token's heads of k and v must be contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.size(2) * k_cache.size(3) == row && k_cache.size(3) == k.size(2) &&
                  k_cache.dtype() == k.dtype() && v_cache.dtype() == k.dtype(),
              "store_kv: caches must be contiguous (num_blocks, block_size, Hkv, D) of k's dtype");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == T &&
                  (slot_mapping.scalar_type() == at::kLong ||
                   slot_mapping.scalar_type() == at::kInt),
              "store_kv: slot_mapping must be (T,) int64 or int32");
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < T; ++t)  // all checked before any write: a bad step changes nothing
    TORCH_CHECK(sp[t] < num_slots, "store_kv: slot_mapping[", t, "] = ", sp[t],
                " is past the cache (", num_slots, " slots)");
  const int64_t bytes = row * k.element_size();
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t ks = k.stride(0) * k.element_size(), vs = v.stride(0) * v.element_size();
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (sp[t] < 0) continue;  // padding: not stored
      std::memcpy(kc + sp[t] * bytes, kp + t * ks, bytes);
      std::memcpy(vc + sp[t] * bytes, vp + t * vs, bytes);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kubeinfer_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("rotary_neox(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor cos_sin_cache) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.def(
      "rms_norm_add(Tensor(a!) out, Tensor(b!) residual_out, Tensor x, Tensor residual, "
      "Tensor weight, float eps) -> ()");
  m.impl("rms_norm_add", c10::DispatchKey::CPU, &rms_norm_add);
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul);
  m.impl("rotary_neox", c10::DispatchKey::CPU, &rotary_neox);
  m.def(
      "store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping)"
      " -> ()");
  m.impl("store_kv", c10::DispatchKey::CPU, &store_kv);
}
