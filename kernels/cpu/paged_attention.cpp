// Paged attention for CPU: one step's attention over the paged KV cache, read in place.
//
// The same contract as kubeinfer.kernels.paged_attention (see its docstring): q (T, H, D) holds
// the step's new tokens by sequence per query_start_loc; caches are (num_blocks, block_size, Hkv,
// D); new token j of sequence i sits at position p = seq_lens[i] - q_len_i + j and sees keys
// max(0, p - window + 1) .. p. Only the sequences listed in seq_ids are computed (the caller
// attends fresh prefills with SDPA over their own new k/v), and only their rows of out written.
//
// A work item is (sequence, a chunk of up to QCHUNK new tokens): its rows are the chunk's tokens
// times the H query heads, and every key and value read from the cache (once, block by block)
// serves all the rows of its KV head. Scores go to a buffer of the item's key range, then an
// exact softmax per row, then the values. Items are spread over ATen's intra-op threads. Keys
// are read through the block table, never gathered into a copy.
//
// `attend_rows` (AVX-512: float32, and bfloat16 with AVX512_BF16; head dims 64 and 128)
// takes the items with at least ROWS_MIN rows per KV head (prefill chunks, and decodes of 8+
// query heads per KV head): rows in the vector lanes, keys broadcast, see there. `run_fast`
// (AVX-512, head dims 64 and 128) takes the rest: scores straight from the cache's type
// (VDPBF16PS for bfloat16 where the CPU has it), the scale folded into the softmax, the values
// accumulated in registers for up to RB rows of one KV head at a time, the next key block
// prefetched into L1 and the current value block into L2 during the key pass (measured on the
// dev machine, 64 decodes of 200-700 tokens over 30 layers' caches: 20-25 % faster than
// converting blocks to float32 and accumulating in memory). `run_avx2` is the AVX2 path (no
// AVX-512) for head dims 64 and 128, `run` the portable path for the rest.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "common.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using kubeinfer_cpu::fast_exp;

constexpr int64_t QCHUNK = 16;

struct Item {
  int32_t seq;
  int32_t cost;  // rows x keys: items run longest first
  int32_t t0;  // first new token of the chunk, relative to the sequence's first new token
  int32_t t1;
};

template <typename T>
inline const float* as_float(const T* src, float* buf, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
  return buf;
}

template <>
inline const float* as_float<float>(const float* src, float*, int64_t) {
  return src;
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

#ifdef __AVX512F__
#include <immintrin.h>
// The 16 sums of 16 vectors, one per lane, in 45 shuffles and adds (16 separate horizontal
// reductions take ~128): pairs within 64-bit halves, then within 128-bit lanes, then across.
inline __m512 hsum16(const __m512* v) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                                  _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88),
                                  _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x88), _mm512_shuffle_f32x4(y0, y1, 0xDD));
}

#define KI_HAVE_DOT16 1

// 16 values of the cache's type as floats
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Scores of one query row against 16 keys k + j * stride read straight from the cache.
template <typename T, int D>
struct Qk16 {
  __m512 qv[D / 16];
  void set(const float* q) {
    for (int d = 0; d < D / 16; ++d) qv[d] = _mm512_loadu_ps(q + 16 * d);
  }
  void run(float* out, const T* k, int64_t stride) const {
    __m512 acc[16];
    for (int j = 0; j < 16; ++j) {
      const T* kj = k + j * stride;
      __m512 a = _mm512_mul_ps(qv[0], load16(kj));
      for (int d = 1; d < D / 16; ++d) a = _mm512_fmadd_ps(qv[d], load16(kj + 16 * d), a);
      acc[j] = a;
    }
    _mm512_storeu_ps(out, hsum16(acc));
  }
};

#ifdef __AVX512BF16__
// bfloat16: pairs of products summed in float32 by VDPBF16PS, the query held in bfloat16 (as
// the model produced it: the scale is applied to the scores).
template <int D>
struct Qk16<c10::BFloat16, D> {
  __m512bh qv[D / 32];
  void set(const float* q) {
    for (int d = 0; d < D / 32; ++d)
      qv[d] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + 32 * d + 16), _mm512_loadu_ps(q + 32 * d));
  }
  void run(float* out, const c10::BFloat16* k, int64_t stride) const {
    __m512 acc[16];
    for (int j = 0; j < 16; ++j) {
      const c10::BFloat16* kj = k + j * stride;
      __m512 a = _mm512_setzero_ps();
      for (int d = 0; d < D / 32; ++d)
        a = _mm512_dpbf16_ps(a, qv[d], (__m512bh)_mm512_loadu_si512(kj + 32 * d));
      acc[j] = a;
    }
    _mm512_storeu_ps(out, hsum16(acc));
  }
};
#endif

// acc[r] += sum_j p[r][j] * v_j over keys j0 .. j1 - 1 for NR rows sharing one KV head, the
// accumulators in registers (D / 16 vectors a row), each value vector loaded once for all rows.
template <typename T, int D, int NR>
inline void pv_rows(__m512 (&acc)[NR][D / 16], const float* const* p, const T* v,
                    int64_t stride, int64_t j0, int64_t j1) {
  for (int64_t j = j0; j < j1; ++j) {
    const T* vj = v + j * stride;
    __m512 vv[D / 16];
    for (int d = 0; d < D / 16; ++d) vv[d] = load16(vj + 16 * d);
    for (int r = 0; r < NR; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r][j]);
      for (int d = 0; d < D / 16; ++d) acc[r][d] = _mm512_fmadd_ps(pr, vv[d], acc[r][d]);
    }
  }
}
#else
#define KI_HAVE_DOT16 0
#endif

inline void axpy(float* __restrict y, float a, const float* __restrict x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// The step's work items; every block id a listed sequence will touch is checked first (a bad one
// would read outside the cache).
std::vector<Item> build_items(const at::Tensor& block_tables, const at::Tensor& seq_lens,
                              const at::Tensor& query_start_loc, const at::Tensor& seq_ids,
                              int64_t num_tokens, int64_t BS, int64_t num_blocks) {
  const int64_t bt_stride = block_tables.stride(0), max_blocks = block_tables.size(1);
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* ids = seq_ids.data_ptr<int32_t>();
  const int64_t num_seqs = seq_lens.size(0), num_ids = seq_ids.size(0);
  std::vector<Item> items;
  for (int64_t n = 0; n < num_ids; ++n) {
    const int32_t s = ids[n];
    TORCH_CHECK(s >= 0 && s < num_seqs, "seq_ids: ", s, " is not a sequence of the step");
    const int64_t q_len = qsl[s + 1] - qsl[s];
    TORCH_CHECK(q_len >= 0 && q_len <= lens[s] && qsl[s] >= 0 && qsl[s + 1] <= num_tokens,
                "sequence ", s, ": its queries must lie in q and number at most seq_lens");
    const int64_t used = (lens[s] + BS - 1) / BS;
    TORCH_CHECK(used <= max_blocks, "sequence ", s,
                ": seq_lens needs more blocks than block_tables has");
    // a bad block id would read outside the cache: check every id the step will touch
    for (int64_t b = 0; b < used; ++b) {
      const int32_t blk = bt[s * bt_stride + b];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "block_tables[", s, ", ", b, "] = ", blk,
                  " is not a cache block");
    }
    for (int64_t t0 = 0; t0 < q_len; t0 += QCHUNK) {
      const int64_t t1 = std::min(q_len, t0 + QCHUNK);
      const int64_t cost = std::min<int64_t>((t1 - t0) * (lens[s] - q_len + t1), INT32_MAX);
      items.push_back({s, static_cast<int32_t>(cost), static_cast<int32_t>(t0),
                       static_cast<int32_t>(t1)});
    }
  }
  // longest first, each thread taking the next item (for_each_item): a step's sequences differ
  // in length by 10x and more, and an even split by count leaves a thread idle
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  return items;
}

// One item's geometry and its queries as float (times mul): rows r = ti * H + h; the keys
// lo .. hi (inclusive) cover every row's own range row_lo[ti] .. row_hi[ti].
struct Chunk {
  int64_t tok0 = 0, nt = 0, lo = 0, hi = 0, nk = 0;  // tok0: the chunk's first row of q
  std::vector<int64_t> row_lo, row_hi;
  std::vector<float> qf;

  template <typename T>
  void set(const Item& it, const int32_t* qsl, const int32_t* lens, int64_t window, const T* qp,
           int64_t q_tok, int64_t q_head, int64_t H, int64_t D, float mul) {
    const int64_t s = it.seq, q_len = qsl[s + 1] - qsl[s];
    const int64_t ctx = lens[s] - q_len;  // tokens before the step's first new token
    tok0 = qsl[s] + it.t0;
    nt = it.t1 - it.t0;
    hi = ctx + it.t1 - 1;
    lo = window > 0 ? std::max<int64_t>(0, ctx + it.t0 - window + 1) : 0;
    nk = hi - lo + 1;
    row_lo.resize(nt);
    row_hi.resize(nt);
    qf.resize(nt * H * D);
    for (int64_t ti = 0; ti < nt; ++ti) {
      const int64_t pos = ctx + it.t0 + ti;
      row_hi[ti] = pos;
      row_lo[ti] = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      for (int64_t h = 0; h < H; ++h) {
        const T* src = qp + (tok0 + ti) * q_tok + h * q_head;
        float* dst = qf.data() + (ti * H + h) * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * mul;
      }
    }
  }
};

// body(item, state) for every item, each thread with a State of its own taking the next item
// from a shared counter (the items come longest first).
template <typename State, typename F>
void for_each_item(const std::vector<Item>& items, F&& body) {
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(items.size());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    State state;
    for (int64_t w; (w = next.fetch_add(1, std::memory_order_relaxed)) < n;) body(items[w], state);
  });
}

// One call's geometry and data pointers, unpacked once (the block ids checked by build_items).
template <typename T>
struct Step {
  int64_t H, D, BS, Hkv, G, row_stride, q_tok, q_head, o_tok, o_head, bt_stride, block_elems;
  const int32_t *bt, *lens, *qsl;
  const T *qp, *kc, *vc;
  T* op;
  float fscale;
  std::vector<Item> items;
  Step(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
       const at::Tensor& block_tables, const at::Tensor& seq_lens,
       const at::Tensor& query_start_loc, const at::Tensor& seq_ids, double scale)
      : H(q.size(1)), D(q.size(2)), BS(k_cache.size(1)), Hkv(k_cache.size(2)), G(H / Hkv),
        row_stride(Hkv * D), q_tok(q.stride(0)), q_head(q.stride(1)), o_tok(out.stride(0)),
        o_head(out.stride(1)), bt_stride(block_tables.stride(0)), block_elems(BS * row_stride),
        bt(block_tables.data_ptr<int32_t>()), lens(seq_lens.data_ptr<int32_t>()),
        qsl(query_start_loc.data_ptr<int32_t>()), qp(q.data_ptr<T>()), kc(k_cache.data_ptr<T>()),
        vc(v_cache.data_ptr<T>()), op(out.data_ptr<T>()), fscale(static_cast<float>(scale)),
        items(build_items(block_tables, seq_lens, query_start_loc, seq_ids, q.size(0), BS,
                          k_cache.size(0))) {}
};

// HD: the head dim when known at compile time (the common sizes), else 0 and D at run time.
template <typename T, int HD>
void run(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
         const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
         const at::Tensor& query_start_loc, const at::Tensor& seq_ids, double scale,
         int64_t window) {
  const int64_t H = q.size(1);
  const int64_t D = HD > 0 ? HD : q.size(2);
  const int64_t num_blocks = k_cache.size(0), BS = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t G = H / Hkv, row_stride = Hkv * D;
  const int64_t q_tok = q.stride(0), q_head = q.stride(1);
  const int64_t o_tok = out.stride(0), o_head = out.stride(1);
  const int64_t bt_stride = block_tables.stride(0);
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int64_t num_tokens = q.size(0);

  const std::vector<Item> items = build_items(block_tables, seq_lens, query_start_loc, seq_ids,
                                              num_tokens, BS, num_blocks);

  const T* qp = q.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t block_elems = BS * row_stride;

  // Rows are (token of the chunk, query head) with head h = g * G + gi; every key of a cache
  // row (all KV heads, contiguous) is read once, in block order, and serves all of them.
  struct State {
    Chunk c;
    std::vector<float> scores, acc, kbuf, vbuf;
  };
  for_each_item<State>(items, [&](const Item& it, State& st) {
    Chunk& c = st.c;
    c.set(it, qsl, lens, window, qp, q_tok, q_head, H, D, fscale);
    const int64_t s = it.seq, nt = c.nt, R = nt * H, lo = c.lo, hi = c.hi, nk = c.nk;
    const std::vector<int64_t>& row_lo = c.row_lo;
    const std::vector<int64_t>& row_hi = c.row_hi;
    std::vector<float>& qf = c.qf;
    std::vector<float>& scores = st.scores;
    std::vector<float>& acc = st.acc;
    st.kbuf.resize(BS * row_stride);
    st.vbuf.resize(BS * row_stride);
    std::vector<float>& kbuf = st.kbuf;
    std::vector<float>& vbuf = st.vbuf;
    scores.resize(R * nk);
    acc.assign(R * D, 0.f);
    const int32_t* table = bt + s * bt_stride;
    auto prefetch_block = [&](const T* base, int64_t b) {
      if (b * BS > hi) return;
      const char* p = reinterpret_cast<const char*>(base + table[b] * block_elems);
      for (int64_t off = 0; off < block_elems * static_cast<int64_t>(sizeof(T)); off += 64)
        __builtin_prefetch(p + off);
    };
    for (int64_t b = lo / BS; b * BS <= hi; ++b) {
      prefetch_block(kc, b + 1);
      const T* kb = kc + table[b] * block_elems;
      const int64_t j0 = std::max(lo, b * BS), j1 = std::min(hi + 1, (b + 1) * BS);
      const float* kt = as_float<T>(kb + (j0 - b * BS) * row_stride, kbuf.data(),
                                    (j1 - j0) * row_stride);  // rows j0 .. j1 - 1
      for (int64_t j = j0; j < j1; ++j) {
        const float* kf = kt + (j - j0) * row_stride;
        for (int64_t r = 0; r < R; ++r)
          scores[r * nk + (j - lo)] = dot(qf.data() + r * D, kf + ((r % H) / G) * D, D);
      }
    }
    for (int64_t ti = 0; ti < nt; ++ti) {  // exact softmax over each row's own keys
      const int64_t a = row_lo[ti] - lo, b = row_hi[ti] - lo;
      for (int64_t h = 0; h < H; ++h) {
        float* sr = scores.data() + (ti * H + h) * nk;
        float m = neg_inf;
        for (int64_t j = a; j <= b; ++j) m = std::max(m, sr[j]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = a; j <= b; ++j) {
          const float e = fast_exp(sr[j] - m);
          sr[j] = e;
          sum += e;
        }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t j = a; j <= b; ++j) sr[j] *= inv;
      }
    }
    for (int64_t b = lo / BS; b * BS <= hi; ++b) {
      prefetch_block(vc, b + 1);
      const T* vb = vc + table[b] * block_elems;
      const int64_t j0 = std::max(lo, b * BS), j1 = std::min(hi + 1, (b + 1) * BS);
      const float* vt = as_float<T>(vb + (j0 - b * BS) * row_stride, vbuf.data(),
                                    (j1 - j0) * row_stride);
      for (int64_t ti = 0; ti < nt; ++ti) {
        const int64_t a = std::max(j0, row_lo[ti]), e = std::min(j1 - 1, row_hi[ti]);
        for (int64_t h = 0; h < H; ++h) {
          const int64_t r = ti * H + h;
          const float* p = scores.data() + r * nk - lo;
          const float* vh = vt + (h / G) * D - j0 * row_stride;
          float* y = acc.data() + r * D;
          for (int64_t j = a; j <= e; ++j) axpy(y, p[j], vh + j * row_stride, D);
        }
      }
    }
    for (int64_t ti = 0; ti < nt; ++ti) {
      const int64_t tok = c.tok0 + ti;
      for (int64_t h = 0; h < H; ++h) {
        T* dst = op + tok * o_tok + h * o_head;
        const float* a = acc.data() + (ti * H + h) * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(a[d]);
      }
    }
  });
}

#if KI_HAVE_DOT16
// Items with many rows per KV head (prefill chunks), float32 and bfloat16 (with AVX512_BF16):
// the rows in the vector lanes. Lane group: 16 rows of one KV head (token of the chunk x query
// head of the group). Its queries are packed once, lane i holding row i (bf16: dims 2p, 2p+1 as
// one pair; float32: dim d); every key is broadcast from the cache, so 16 rows' scores for 8 keys
// come from VDPBF16PS / FMA alone (no key transpose, no horizontal sums). Scores stay key-major
// (s[j][lane]): the softmax runs down the keys for all 16 rows at once. The values: bf16 by key
// pairs, the probabilities as bf16 pairs (p_j, p_j+1) per row and each value pair interleaved
// (v_j[d], v_j+1[d]) once for RB rows, one VDPBF16PS per 16 dims; float32 key by key, one FMA
// per 16 dims.
// Measured on the dev machine (AMD EPYC with avx512_bf16, 2 threads, 9 query / 3 KV heads of
// 64), fresh prefills in bfloat16: 39 vs 106 us at 64 tokens, 425 vs 976 at 264, 1.45 vs 3.3 ms
// at 512, 23 vs 47 ms at 2048 against the keys-in-lanes path below (SDPA's flash kernel: 128 us,
// 1.3, 4.4 and 43 ms). The probabilities' rounding to bf16 adds little: 0.173 % relative L2
// error against an exact float32 attention where rounding the output alone gives 0.164 %.
struct RowsBuf {
  std::vector<uint32_t> qp, pb;  // query (bf16 pairs or float bits), probabilities (bf16 pairs)
  std::vector<float> s;
};

constexpr int64_t ROWS_MIN = 8;  // rows per KV head from which an item takes the lanes path

template <typename T>
constexpr bool has_rows_path() {
#ifdef __AVX512BF16__
  return std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;
#else
  return std::is_same_v<T, float>;
#endif
}

inline __m512i word_index(int a, int b) {  // words 2i <- a + i, 2i + 1 <- b + i
  alignas(64) int16_t idx[32];
  for (int i = 0; i < 16; ++i) {
    idx[2 * i] = static_cast<int16_t>(a + i);
    idx[2 * i + 1] = static_cast<int16_t>(b + i);
  }
  return _mm512_load_si512(idx);
}

template <typename T, int D>
void attend_rows(const Chunk& c, int64_t H, int64_t G, int64_t Hkv, const int32_t* table,
                 const T* kc, const T* vc, int64_t BS, int64_t block_elems, int64_t row_stride,
                 float fscale, T* op, int64_t o_tok, int64_t o_head, RowsBuf& buf) {
  constexpr bool BF = std::is_same_v<T, c10::BFloat16>;
  constexpr int NQ = BF ? D / 2 : D;  // packed query words per row (bf16 pairs or floats)
  constexpr int RB = D == 64 ? 4 : 2;  // rows whose value accumulators stay in registers
  const int64_t nt = c.nt, lo = c.lo, nk = c.nk, M = nt * G, npair = (nk + 1) / 2;
  buf.qp.resize(NQ * 16);
  buf.s.resize(nk * 16);
  buf.pb.resize(npair * 16);
  uint32_t* QP = buf.qp.data();
  float* S = buf.s.data();
  uint32_t* PB = buf.pb.data();
  auto at = [&](const T* base, int64_t j, int64_t g) {
    return base + table[j / BS] * block_elems + (j % BS) * row_stride + g * D;
  };
  for (int64_t g = 0; g < Hkv; ++g) {
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
      const int64_t nl = std::min<int64_t>(16, M - m0);
      alignas(64) int32_t lane_lo[16], lane_hi[16];
      alignas(64) float mx[16], sum[16];
      for (int i = 0; i < 16; ++i) {
        mx[i] = -std::numeric_limits<float>::infinity();
        sum[i] = 0.f;
        if (i >= nl) {  // no row: no keys, zero queries
          for (int p = 0; p < NQ; ++p) QP[p * 16 + i] = 0;
          lane_lo[i] = 1;
          lane_hi[i] = 0;
          continue;
        }
        const int64_t m = m0 + i, ti = m / G;
        const float* qr = c.qf.data() + (ti * H + g * G + m % G) * D;
        for (int p = 0; p < NQ; ++p) {
          if constexpr (BF) {
            QP[p * 16 + i] = static_cast<uint32_t>(c10::BFloat16(qr[2 * p]).x) |
                             (static_cast<uint32_t>(c10::BFloat16(qr[2 * p + 1]).x) << 16);
          } else {
            std::memcpy(QP + p * 16 + i, qr + p, sizeof(float));
          }
        }
        lane_lo[i] = static_cast<int32_t>(c.row_lo[ti] - lo);
        lane_hi[i] = static_cast<int32_t>(c.row_hi[ti] - lo);
      }
      // one key word (a bf16 pair or a float) times 16 rows' query words, into acc
      auto madd = [](__m512 acc, __m512i q, const uint32_t* key_word) {
#ifdef __AVX512BF16__
        if constexpr (BF)
          return _mm512_dpbf16_ps(acc, (__m512bh)q, (__m512bh)_mm512_set1_epi32(*key_word));
#endif
        return _mm512_fmadd_ps(_mm512_castsi512_ps(q),
                               _mm512_set1_ps(*reinterpret_cast<const float*>(key_word)), acc);
      };
      int64_t j = 0;  // scores, 8 keys at a time: 16 query words in registers per pass
      for (; j + 8 <= nk; j += 8) {
        const uint32_t* kp[8];
        for (int kk = 0; kk < 8; ++kk)
          kp[kk] = reinterpret_cast<const uint32_t*>(at(kc, lo + j + kk, g));
        __m512 acc[8];
        for (int kk = 0; kk < 8; ++kk) acc[kk] = _mm512_setzero_ps();
        for (int p0 = 0; p0 < NQ; p0 += 16) {
          __m512i qv[16];
          for (int p = 0; p < 16; ++p) qv[p] = _mm512_loadu_si512(QP + (p0 + p) * 16);
          for (int kk = 0; kk < 8; ++kk)
            for (int p = 0; p < 16; ++p) acc[kk] = madd(acc[kk], qv[p], kp[kk] + p0 + p);
        }
        for (int kk = 0; kk < 8; ++kk) _mm512_storeu_ps(S + (j + kk) * 16, acc[kk]);
      }
      for (; j < nk; ++j) {
        const uint32_t* kp = reinterpret_cast<const uint32_t*>(at(kc, lo + j, g));
        __m512 acc = _mm512_setzero_ps();
        for (int p = 0; p < NQ; ++p) acc = madd(acc, _mm512_loadu_si512(QP + p * 16), kp + p);
        _mm512_storeu_ps(S + j * 16, acc);
      }
      for (int64_t jj = 0; jj < nk; ++jj) {  // exact softmax down the keys, 16 rows at once
        const float* sj = S + jj * 16;
        const int32_t k = static_cast<int32_t>(jj);
#pragma omp simd
        for (int i = 0; i < 16; ++i)
          mx[i] = (k >= lane_lo[i] && k <= lane_hi[i]) ? std::max(mx[i], sj[i]) : mx[i];
      }
      for (int i = 0; i < 16; ++i)
        if (mx[i] == -std::numeric_limits<float>::infinity()) mx[i] = 0.f;
      for (int64_t jj = 0; jj < nk; ++jj) {
        float* sj = S + jj * 16;
        const int32_t k = static_cast<int32_t>(jj);
#pragma omp simd
        for (int i = 0; i < 16; ++i) {
          const float e = fast_exp((sj[i] - mx[i]) * fscale);
          sj[i] = (k >= lane_lo[i] && k <= lane_hi[i]) ? e : 0.f;
          sum[i] += sj[i];
        }
      }
      for (int64_t r0 = 0; r0 < nl; r0 += RB) {  // the values; lanes past nl have p = 0
        __m512 acc[RB][D / 16];
        for (int r = 0; r < RB; ++r)
          for (int d = 0; d < D / 16; ++d) acc[r][d] = _mm512_setzero_ps();
        if constexpr (BF) {
#ifdef __AVX512BF16__
          if (r0 == 0) {  // the probabilities as bf16 pairs (p_2q, p_2q+1), once per lane group
            const __m512i ilv = word_index(0, 16);
            for (int64_t q = 0; q < npair; ++q) {
              const __m512 a = _mm512_loadu_ps(S + 2 * q * 16);
              const __m512 b =
                  2 * q + 1 < nk ? _mm512_loadu_ps(S + (2 * q + 1) * 16) : _mm512_setzero_ps();
              const __m512i w = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // words 0-15: a, 16-31: b
              _mm512_storeu_si512(PB + q * 16, _mm512_permutexvar_epi16(ilv, w));
            }
          }
          const __m512i v_lo = word_index(0, 32), v_hi = word_index(16, 48);
          for (int64_t q = 0; q < npair; ++q) {
            const int64_t jk = lo + 2 * q;
            const T* va = at(vc, jk, g);
            const T* vb = 2 * q + 1 < nk ? at(vc, jk + 1, g) : nullptr;
            __m512i vp[D / 16];
            for (int d = 0; d < D / 32; ++d) {
              const __m512i A = _mm512_loadu_si512(va + 32 * d);
              const __m512i B = vb ? _mm512_loadu_si512(vb + 32 * d) : _mm512_setzero_si512();
              vp[2 * d] = _mm512_permutex2var_epi16(A, v_lo, B);
              vp[2 * d + 1] = _mm512_permutex2var_epi16(A, v_hi, B);
            }
            for (int r = 0; r < RB; ++r) {
              const __m512bh pr = (__m512bh)_mm512_set1_epi32(PB[q * 16 + r0 + r]);
              for (int d = 0; d < D / 16; ++d)
                acc[r][d] = _mm512_dpbf16_ps(acc[r][d], pr, (__m512bh)vp[d]);
            }
          }
#endif
        } else {
          for (int64_t jj = 0; jj < nk; ++jj) {
            const float* vj = reinterpret_cast<const float*>(at(vc, lo + jj, g));
            __m512 vv[D / 16];
            for (int d = 0; d < D / 16; ++d) vv[d] = _mm512_loadu_ps(vj + 16 * d);
            for (int r = 0; r < RB; ++r) {
              const __m512 pr = _mm512_set1_ps(S[jj * 16 + r0 + r]);
              for (int d = 0; d < D / 16; ++d) acc[r][d] = _mm512_fmadd_ps(pr, vv[d], acc[r][d]);
            }
          }
        }
        for (int r = 0; r < RB && r0 + r < nl; ++r) {
          const int64_t m = m0 + r0 + r, ti = m / G;
          T* dst = op + (c.tok0 + ti) * o_tok + (g * G + m % G) * o_head;
          const __m512 iv = _mm512_set1_ps(1.f / sum[r0 + r]);
          for (int d = 0; d < D / 16; ++d) {
            const __m512 y = _mm512_mul_ps(acc[r][d], iv);
            if constexpr (BF) {
#ifdef __AVX512BF16__
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * d),
                                  (__m256i)_mm512_cvtneps_pbh(y));
#endif
            } else {
              _mm512_storeu_ps(reinterpret_cast<float*>(dst) + 16 * d, y);
            }
          }
        }
      }
    }
  }
}
#endif

#if KI_HAVE_DOT16
// acc rows += p rows . values for NR rows sharing one KV head, over keys j0 .. j1 - 1 of one
// block (key j at v + j * stride): the accumulators live in registers for the block.
template <typename T, int D, int NR>
inline void attend_block(float* const* acc, const float* const* p, const T* v, int64_t stride,
                         int64_t j0, int64_t j1) {
  __m512 a[NR][D / 16];
  for (int r = 0; r < NR; ++r)
    for (int d = 0; d < D / 16; ++d) a[r][d] = _mm512_loadu_ps(acc[r] + 16 * d);
  pv_rows<T, D, NR>(a, p, v, stride, j0, j1);
  for (int r = 0; r < NR; ++r)
    for (int d = 0; d < D / 16; ++d) _mm512_storeu_ps(acc[r] + 16 * d, a[r][d]);
}

// The AVX-512 path for head dims 64 and 128: scores from the cache's own type (bf16 dot products
// where the CPU has them), an exact softmax with the scale folded in, then the values with each
// row group's accumulators in registers. Same items, same contract as `run`.
template <typename T, int D>
void run_fast(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
              const at::Tensor& v_cache, const at::Tensor& block_tables,
              const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
              const at::Tensor& seq_ids, double scale, int64_t window) {
  constexpr int RB = D == 64 ? 4 : 2;  // rows one value pass keeps in registers
  const int64_t H = q.size(1);
  const int64_t num_blocks = k_cache.size(0), BS = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t G = H / Hkv, row_stride = Hkv * D;
  const int64_t q_tok = q.stride(0), q_head = q.stride(1);
  const int64_t o_tok = out.stride(0), o_head = out.stride(1);
  const int64_t bt_stride = block_tables.stride(0);
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const std::vector<Item> items = build_items(block_tables, seq_lens, query_start_loc, seq_ids,
                                              q.size(0), BS, num_blocks);
  const T* qp = q.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t block_elems = BS * row_stride;

  struct State {
    Chunk c;
    std::vector<float> scores, inv, acc;
    RowsBuf rows;
  };
  for_each_item<State>(items, [&](const Item& it, State& st) {
    Chunk& c = st.c;
    c.set(it, qsl, lens, window, qp, q_tok, q_head, H, D, 1.f);
    if constexpr (has_rows_path<T>()) {
      if (c.nt * G >= ROWS_MIN) {
        attend_rows<T, D>(c, H, G, Hkv, bt + it.seq * bt_stride, kc, vc, BS, block_elems,
                          row_stride, fscale, op, o_tok, o_head, st.rows);
        return;
      }
    }
    const int64_t s = it.seq, nt = c.nt, R = nt * H, lo = c.lo, hi = c.hi, nk = c.nk;
    const std::vector<int64_t>& row_lo = c.row_lo;
    const std::vector<int64_t>& row_hi = c.row_hi;
    const std::vector<float>& qf = c.qf;
    std::vector<float>& scores = st.scores;
    std::vector<float>& inv = st.inv;
    std::vector<float>& acc = st.acc;
    scores.resize(R * nk);
    inv.resize(R);
    const int32_t* table = bt + s * bt_stride;
    for (int64_t b = lo / BS; b * BS <= hi; ++b) {
      if ((b + 1) * BS <= hi) {
        const char* next = reinterpret_cast<const char*>(kc + table[b + 1] * block_elems);
        for (int64_t off = 0; off < block_elems * static_cast<int64_t>(sizeof(T)); off += 64)
          __builtin_prefetch(next + off);
      }
      {  // this block's values, towards L2 for the value pass
        const char* vb = reinterpret_cast<const char*>(vc + table[b] * block_elems);
        for (int64_t off = 0; off < block_elems * static_cast<int64_t>(sizeof(T)); off += 64)
          __builtin_prefetch(vb + off, 0, 2);
      }
      const int64_t j0 = std::max(lo, b * BS), j1 = std::min(hi + 1, (b + 1) * BS);
      for (int64_t g = 0; g < Hkv; ++g) {
        const T* kg = kc + table[b] * block_elems + g * D - b * BS * row_stride;
        for (int64_t ti = 0; ti < nt; ++ti)
          for (int64_t gi = 0; gi < G; ++gi) {
            const int64_t r = ti * H + g * G + gi;
            const float* qr = qf.data() + r * D;
            float* sr = scores.data() + r * nk - lo;
            int64_t j = j0;
            if (j + 16 <= j1) {
              Qk16<T, D> qk;
              qk.set(qr);
              for (; j + 16 <= j1; j += 16) qk.run(sr + j, kg + j * row_stride, row_stride);
            }
            for (; j < j1; ++j) {
              const T* kj = kg + j * row_stride;
              float acc = 0.f;
#pragma omp simd reduction(+ : acc)
              for (int64_t d = 0; d < D; ++d) acc += qr[d] * static_cast<float>(kj[d]);
              sr[j] = acc;
            }
          }
      }
    }
    for (int64_t ti = 0; ti < nt; ++ti) {  // exact softmax over each row's own keys
      const int64_t a = row_lo[ti] - lo, b = row_hi[ti] - lo;
      for (int64_t h = 0; h < H; ++h) {
        float* sr = scores.data() + (ti * H + h) * nk;
        float m = neg_inf;
        for (int64_t j = a; j <= b; ++j) m = std::max(m, sr[j]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = a; j <= b; ++j) {
          const float e = fast_exp((sr[j] - m) * fscale);
          sr[j] = e;
          sum += e;
        }
        inv[ti * H + h] = 1.f / sum;
      }
    }
    acc.assign(R * D, 0.f);
    for (int64_t b = lo / BS; b * BS <= hi; ++b) {  // values: each block read once, in order
      if ((b + 1) * BS <= hi) {
        const char* next = reinterpret_cast<const char*>(vc + table[b + 1] * block_elems);
        for (int64_t off = 0; off < block_elems * static_cast<int64_t>(sizeof(T)); off += 64)
          __builtin_prefetch(next + off);
      }
      for (int64_t ti = 0; ti < nt; ++ti) {
        const int64_t j0 = std::max(b * BS, row_lo[ti]);
        const int64_t j1 = std::min((b + 1) * BS, row_hi[ti] + 1);
        if (j0 >= j1) continue;
        for (int64_t g = 0; g < Hkv; ++g) {
          const T* vg = vc + table[b] * block_elems + g * D - b * BS * row_stride;
          for (int64_t c = 0; c < G; c += RB) {
            const float* p[RB];
            float* a[RB];
            const int64_t nr = std::min<int64_t>(RB, G - c);
            for (int64_t r = 0; r < nr; ++r) {
              const int64_t row = ti * H + g * G + c + r;
              p[r] = scores.data() + row * nk - lo;
              a[r] = acc.data() + row * D;
            }
            switch (nr) {
              case 1: attend_block<T, D, 1>(a, p, vg, row_stride, j0, j1); break;
              case 2: attend_block<T, D, 2>(a, p, vg, row_stride, j0, j1); break;
              case 3:
                if constexpr (RB >= 3) attend_block<T, D, 3>(a, p, vg, row_stride, j0, j1);
                break;
              default:
                if constexpr (RB >= 4) attend_block<T, D, 4>(a, p, vg, row_stride, j0, j1);
                break;
            }
          }
        }
      }
    }
    for (int64_t ti = 0; ti < nt; ++ti) {
      const int64_t tok = c.tok0 + ti;
      for (int64_t h = 0; h < H; ++h) {
        T* dst = op + tok * o_tok + h * o_head;
        const float* a = acc.data() + (ti * H + h) * D;
        const float iv = inv[ti * H + h];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(a[d] * iv);
      }
    }
  });
}
#endif

#if !KI_HAVE_DOT16 && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KI_HAVE_AVX2 1
// AVX2 (no AVX-512: 8 float lanes, 16 registers) for head dims 64 and 128. Each cache block is
// read once per item as float (bfloat16/float16 widened into a scratch block, float32 in place)
// and serves every row of the item; scores 8 keys at a time per row (the 8 dot products summed
// across lanes together, `hsum8`), an exact softmax with the scale folded in, then the values
// with each row's accumulators in registers for the block. Same items, same contract as `run`.
// Measured on the AVX2-only dev machine (AMD EPYC, 2 threads, 9 query / 3 KV heads of 64,
// blocks of 16 at random places) against `run` (compiler-vectorized, one dot product and one
// axpy through memory per row and key, a scalar softmax): 64 decodes of 200-700 tokens 2.7 vs
// 3.8 ms float32 and 2.1 vs 4.0 ms bfloat16; a fresh 256-token prefill 0.90 vs 3.1 ms and 1.07
// vs 3.2 ms; 8 chunks of 16 over 300 tokens 1.06 vs 4.1 ms and 1.2 vs 3.6 ms. Fresh prefills
// against SDPA's flash kernel, float32: 104 vs 219 us at 64 tokens, 1.0 vs 1.6 ms at 256, 3.2
// vs 5.1 ms at 512, even at 1024 (15.5 vs 14.8 ms), so FRESH_SDPA_OVER (512) holds here too.
inline __m256 hsum8(const __m256* v) {  // lane i: the sum of v[i]'s 8 lanes
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// n values of the cache's type (n a multiple of 8) as floats: in place for float32
template <typename T>
inline const float* widen(const T* src, float* buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    for (int64_t i = 0; i < n; i += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      if constexpr (std::is_same_v<T, c10::BFloat16>)
        _mm256_storeu_ps(buf + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
      else
        _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(h));
    }
    return buf;
  }
}

// fast_exp (common.h) on 8 lanes: the same clamp, reduction and degree-7 polynomial
inline __m256 fast_exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693147180559945309f), x);
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  for (const float c : {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
  const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}

// sr[a..e] <- exp((sr - max) * scale); returns their sum
inline float softmax_row8(float* sr, int64_t a, int64_t e, float scale) {
  __m256 m8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = a;
  for (; j + 8 <= e + 1; j += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(sr + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m8);
  float m = *std::max_element(lanes, lanes + 8);
  for (; j <= e; ++j) m = std::max(m, sr[j]);
  const __m256 mv = _mm256_set1_ps(m), sv = _mm256_set1_ps(scale);
  __m256 sum8 = _mm256_setzero_ps();
  for (j = a; j + 8 <= e + 1; j += 8) {
    const __m256 x = fast_exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(sr + j), mv), sv));
    _mm256_storeu_ps(sr + j, x);
    sum8 = _mm256_add_ps(sum8, x);
  }
  _mm256_store_ps(lanes, sum8);
  float sum = 0.f;
  for (const float x : lanes) sum += x;
  for (; j <= e; ++j) {
    sr[j] = fast_exp((sr[j] - m) * scale);
    sum += sr[j];
  }
  return sum;
}

template <typename T, int D>
void run_avx2(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
              const at::Tensor& v_cache, const at::Tensor& block_tables,
              const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
              const at::Tensor& seq_ids, double scale, int64_t window) {
  constexpr int NV = D / 8;
  const Step<T> p(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, seq_ids,
                  scale);
  const int64_t H = p.H, G = p.G, BS = p.BS, row_stride = p.row_stride;
  const int64_t block_elems = p.block_elems;
  const T *kc = p.kc, *vc = p.vc;

  struct State {
    Chunk c;
    std::vector<float> scores, inv, acc, buf;
  };
  for_each_item<State>(p.items, [&](const Item& it, State& st) {
    Chunk& c = st.c;
    c.set(it, p.qsl, p.lens, window, p.qp, p.q_tok, p.q_head, H, D, 1.f);
    const int64_t nt = c.nt, R = nt * H, lo = c.lo, hi = c.hi, nk = c.nk;
    const std::vector<int64_t>& row_lo = c.row_lo;
    const std::vector<int64_t>& row_hi = c.row_hi;
    const float* qf = c.qf.data();
    st.scores.resize(R * nk);
    st.inv.resize(R);
    st.buf.resize(block_elems);
    st.acc.assign(R * D, 0.f);
    float* scores = st.scores.data();
    const int32_t* table = p.bt + it.seq * p.bt_stride;
    auto prefetch = [&](const T* base, int64_t b) {
      if (b * BS > hi) return;
      const char* addr = reinterpret_cast<const char*>(base + table[b] * block_elems);
      for (int64_t off = 0; off < block_elems * static_cast<int64_t>(sizeof(T)); off += 64)
        __builtin_prefetch(addr + off);
    };
    for (int64_t b = lo / BS; b * BS <= hi; ++b) {  // scores, each key block read once
      prefetch(kc, b + 2);
      const int64_t j0 = std::max(lo, b * BS), j1 = std::min(hi + 1, (b + 1) * BS);
      const float* kb = widen<T>(kc + table[b] * block_elems, st.buf.data(), block_elems) -
                        b * BS * row_stride;  // key j, head g at kb + j * row_stride + g * D
      for (int64_t r = 0; r < R; ++r) {
        const int64_t g = (r % H) / G;
        const float* qr = qf + r * D;
        const float* kg = kb + g * D;
        float* sr = scores + r * nk - lo;
        int64_t j = j0;
        for (; j + 8 <= j1; j += 8) {
          __m256 acc[8];
          for (int kk = 0; kk < 8; ++kk) {
            const float* kj = kg + (j + kk) * row_stride;
            __m256 a = _mm256_mul_ps(_mm256_loadu_ps(kj), _mm256_loadu_ps(qr));
            for (int d = 1; d < NV; ++d)
              a = _mm256_fmadd_ps(_mm256_loadu_ps(kj + 8 * d), _mm256_loadu_ps(qr + 8 * d), a);
            acc[kk] = a;
          }
          _mm256_storeu_ps(sr + j, hsum8(acc));
        }
        for (; j < j1; ++j) {
          const float* kj = kg + j * row_stride;
          __m256 a = _mm256_mul_ps(_mm256_loadu_ps(kj), _mm256_loadu_ps(qr));
          for (int d = 1; d < NV; ++d)
            a = _mm256_fmadd_ps(_mm256_loadu_ps(kj + 8 * d), _mm256_loadu_ps(qr + 8 * d), a);
          __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
          h = _mm_hadd_ps(h, h);
          sr[j] = _mm_cvtss_f32(_mm_hadd_ps(h, h));
        }
      }
    }
    for (int64_t ti = 0; ti < nt; ++ti) {  // exact softmax over each row's own keys
      const int64_t a = row_lo[ti] - lo, e = row_hi[ti] - lo;
      for (int64_t h = 0; h < H; ++h)
        st.inv[ti * H + h] = 1.f / softmax_row8(scores + (ti * H + h) * nk, a, e, p.fscale);
    }
    for (int64_t b = lo / BS; b * BS <= hi; ++b) {  // values, each block read once
      prefetch(vc, b + 2);
      const float* vb = widen<T>(vc + table[b] * block_elems, st.buf.data(), block_elems) -
                        b * BS * row_stride;
      for (int64_t ti = 0; ti < nt; ++ti) {
        const int64_t j0 = std::max(b * BS, row_lo[ti]);
        const int64_t j1 = std::min((b + 1) * BS, row_hi[ti] + 1);
        if (j0 >= j1) continue;
        for (int64_t h = 0; h < H; ++h) {
          const int64_t r = ti * H + h;
          const float* pr = scores + r * nk - lo;
          const float* vh = vb + (h / G) * D;
          float* y = st.acc.data() + r * D;
          __m256 a[NV];
          for (int d = 0; d < NV; ++d) a[d] = _mm256_loadu_ps(y + 8 * d);
          for (int64_t j = j0; j < j1; ++j) {
            const __m256 pj = _mm256_set1_ps(pr[j]);
            const float* vj = vh + j * row_stride;
            for (int d = 0; d < NV; ++d) a[d] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * d), a[d]);
          }
          for (int d = 0; d < NV; ++d) _mm256_storeu_ps(y + 8 * d, a[d]);
        }
      }
    }
    for (int64_t ti = 0; ti < nt; ++ti) {
      const int64_t tok = c.tok0 + ti;
      for (int64_t h = 0; h < H; ++h) {
        T* dst = p.op + tok * p.o_tok + h * p.o_head;
        const float* a = st.acc.data() + (ti * H + h) * D;
        const float iv = st.inv[ti * H + h];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(a[d] * iv);
      }
    }
  });
}
#else
#define KI_HAVE_AVX2 0
#endif

// The vector path this build has, for head dims 64 and 128.
#if KI_HAVE_DOT16
template <typename T, int D>
constexpr auto run_vec = &run_fast<T, D>;
#elif KI_HAVE_AVX2
template <typename T, int D>
constexpr auto run_vec = &run_avx2<T, D>;
#endif

template <typename T>
void run_dim(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
             const at::Tensor& v_cache, const at::Tensor& block_tables,
             const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
             const at::Tensor& seq_ids, double scale, int64_t window) {
#if KI_HAVE_DOT16 || KI_HAVE_AVX2
  switch (q.size(2)) {
    case 64:
      return run_vec<T, 64>(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                            seq_ids, scale, window);
    case 128:
      return run_vec<T, 128>(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                             seq_ids, scale, window);
    default:
      break;
  }
#endif
  run<T, 0>(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, seq_ids, scale,
            window);
}

void paged_attention_cpu(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                         const at::Tensor& seq_ids, double scale, int64_t sliding_window) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &q, &k_cache, &v_cache, &block_tables, &seq_lens,
                              &query_start_loc, &seq_ids})
    TORCH_CHECK(t->device().is_cpu(), "paged_attention_cpu takes CPU tensors");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be (T, H, D) alike");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q and out need contiguous heads");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must be (num_blocks, block_size, Hkv, D) alike");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.size(3) == q.size(2), "head_dim of q and the caches differ");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == out.scalar_type() &&
                  q.scalar_type() == v_cache.scalar_type(),
              "q, out and the caches must share one dtype");
  for (const at::Tensor* t : {&block_tables, &seq_lens, &query_start_loc, &seq_ids})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->stride(-1) == 1,
                "block_tables, seq_lens, query_start_loc and seq_ids must be int32, "
                "contiguous rows");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == seq_lens.size(0) &&
                  query_start_loc.size(0) == seq_lens.size(0) + 1,
              "block_tables (S, max_blocks), seq_lens (S,), query_start_loc (S + 1,)");
  TORCH_CHECK(sliding_window >= 0, "sliding_window must be >= 0 (0: none)");
  switch (q.scalar_type()) {
    case at::kFloat:
      run_dim<float>(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, seq_ids,
                 scale, sliding_window);
      break;
    case at::kBFloat16:
      run_dim<c10::BFloat16>(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                         seq_ids, scale, sliding_window);
      break;
    case at::kHalf:
      run_dim<c10::Half>(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, seq_ids,
                     scale, sliding_window);
      break;
    default:
      TORCH_CHECK(false, "paged_attention_cpu: float32, bfloat16 or float16, got ",
                  q.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(kubeinfer_cpu, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, Tensor seq_ids, "
      "float scale, int sliding_window) -> ()");
  m.impl("paged_attention", c10::DispatchKey::CPU, &paged_attention_cpu);
}
