// CPU kernels of kvpilot's fast CPU path. Paged attention: every query reads its keys and values in place through its
// sequence's block table (no gathered copy of the context), with an online softmax over
// chunks of keys (flash-attention style), grouped-query heads and sliding windows.
//
// Built on first use by kvpilot/model/kernels/build.py (g++ -O3 -march=native -fopenmp) and
// called through ctypes; OpenMP shares torch's libgomp (same soname, already loaded).
//
// Layout (one layer):
//   q, out        [T, H, D]                      T flat query tokens of all works
//   k/v cache     [num_blocks, B, H_kv, D]       position p of work w lives at
//                                                block_tables[w][p / B], offset p % B
//   work w        query tokens q_start[w] .. q_start[w] + q_len[w] - 1, at positions
//                 ctx_len[w] - q_len[w] .. ctx_len[w] - 1 (its keys are already written)
//
//   query at position p sees keys  max(0, p - window + 1) .. p     (window 0: no window)
//
// One work item = (work, kv head, tile of query tokens): its rows are the tile's tokens
// times the G = H / H_kv query heads sharing that kv head, so each key is loaded once
// for all of them.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int KEY_CHUNK = 64;  // keys scored per online-softmax step
constexpr int MAX_ROWS = 32;    // query rows (tokens x group) per work item
constexpr int MAX_HEAD_DIM = 256;
constexpr int64_t PARALLEL_MIN_ELEMENTS = 1 << 15;  // below this one thread is faster

inline float load(float x) { return x; }
inline float load(uint16_t x) {  // bfloat16 -> float
    uint32_t bits = uint32_t(x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}
inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) {  // float -> bfloat16, round to nearest even
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu)) {
        *p = uint16_t((bits >> 16) | 0x40u);  // NaN stays NaN
        return;
    }
    bits += 0x7fffu + ((bits >> 16) & 1u);
    *p = uint16_t(bits >> 16);
}

// exp(x) for x <= 0 to ~2 ulp, written so the compiler vectorizes loops that call it.
inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = std::nearbyint(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;  // Cody-Waite: ln2 split in two parts
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = (int32_t(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

// -- the inner loops: AVX2 + FMA where the compiler targets it, plain loops otherwise -----

#if defined(__AVX2__) && defined(__FMA__)

inline __m256 exp256_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// out[i] = dot(q, k_i) for four keys; D a multiple of 8.
inline void dot4(const float* q, const float* k0, const float* k1, const float* k2,
                 const float* k3, int64_t D, float* out) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + d), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + d), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + d), a3);
    }
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}

inline float dot1(const float* q, const float* k, int64_t D) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8)
        a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

// acc += p * v over D (a multiple of 8).
inline void axpy(float* acc, float p, const float* v, int64_t D) {
    const __m256 pv = _mm256_set1_ps(p);
    for (int64_t d = 0; d < D; d += 8)
        _mm256_storeu_ps(acc + d,
                         _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + d), _mm256_loadu_ps(acc + d)));
}

// p[j] = exp(s[j] - m) (0 where s[j] is -inf); returns the sum.
inline float exp_row(float* s, int64_t n, float m) {
    const __m256 mv = _mm256_set1_ps(m), ninf = _mm256_set1_ps(-INFINITY);
    __m256 total = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 x = _mm256_loadu_ps(s + j);
        __m256 e = exp256_nonpositive(_mm256_sub_ps(x, mv));
        e = _mm256_andnot_ps(_mm256_cmp_ps(x, ninf, _CMP_EQ_OQ), e);
        _mm256_storeu_ps(s + j, e);
        total = _mm256_add_ps(total, e);
    }
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1));
    h = _mm_hadd_ps(h, h);
    h = _mm_hadd_ps(h, h);
    float sum = _mm_cvtss_f32(h);
    for (; j < n; ++j) {
        s[j] = s[j] == -INFINITY ? 0.0f : exp_nonpositive(s[j] - m);
        sum += s[j];
    }
    return sum;
}
constexpr bool kVector = true;
#else
inline void dot4(const float*, const float*, const float*, const float*, const float*, int64_t,
                 float*) {}
inline float dot1(const float*, const float*, int64_t) { return 0.0f; }
inline void axpy(float*, float, const float*, int64_t) {}
inline float exp_row(float*, int64_t, float) { return 0.0f; }
constexpr bool kVector = false;
#endif

inline float dot_plain(const float* q, const float* k, int64_t D) {
    float dot = 0.0f;
    for (int64_t d = 0; d < D; ++d) dot += q[d] * k[d];
    return dot;
}

// Pointers to the D floats of keys (or values) c0 .. c0 + n - 1 of one head, in place for a
// float32 pool; bfloat16 rows are converted into ``buffer`` (KEY_CHUNK rows) first.
inline void key_rows(const float* cache, const int64_t* table, int64_t c0, int64_t n,
                     int64_t block_stride, int64_t token_stride, int64_t head_offset, int64_t B,
                     int64_t, float (*)[MAX_HEAD_DIM], const float** rows) {
    for (int64_t j = 0; j < n; ++j) {
        const int64_t pos = c0 + j;
        rows[j] = cache + table[pos / B] * block_stride + (pos % B) * token_stride + head_offset;
    }
}
inline void key_rows(const uint16_t* cache, const int64_t* table, int64_t c0, int64_t n,
                     int64_t block_stride, int64_t token_stride, int64_t head_offset, int64_t B,
                     int64_t D, float (*buffer)[MAX_HEAD_DIM], const float** rows) {
    for (int64_t j = 0; j < n; ++j) {
        const int64_t pos = c0 + j;
        const uint16_t* src =
            cache + table[pos / B] * block_stride + (pos % B) * token_stride + head_offset;
        for (int64_t d = 0; d < D; ++d) buffer[j][d] = load(src[d]);
        rows[j] = buffer[j];
    }
}

// acc[0 .. D) += sum_j p[j] * rows[j][0 .. D), 32 lanes of acc held in registers at a time.
inline void accumulate(float* acc, const float* p, const float* const* rows, int64_t n,
                       int64_t D) {
#if defined(__AVX2__) && defined(__FMA__)
    int64_t d = 0;
    for (; d + 32 <= D; d += 32) {
        __m256 a0 = _mm256_loadu_ps(acc + d), a1 = _mm256_loadu_ps(acc + d + 8);
        __m256 a2 = _mm256_loadu_ps(acc + d + 16), a3 = _mm256_loadu_ps(acc + d + 24);
        for (int64_t j = 0; j < n; ++j) {
            const __m256 pv = _mm256_set1_ps(p[j]);
            const float* v = rows[j] + d;
            a0 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v), a0);
            a1 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + 8), a1);
            a2 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + 16), a2);
            a3 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + 24), a3);
        }
        _mm256_storeu_ps(acc + d, a0);
        _mm256_storeu_ps(acc + d + 8, a1);
        _mm256_storeu_ps(acc + d + 16, a2);
        _mm256_storeu_ps(acc + d + 24, a3);
    }
    for (; d < D; d += 8) {
        __m256 a = _mm256_loadu_ps(acc + d);
        for (int64_t j = 0; j < n; ++j)
            a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(rows[j] + d), a);
        _mm256_storeu_ps(acc + d, a);
    }
#else
    for (int64_t j = 0; j < n; ++j)
        for (int64_t d = 0; d < D; ++d) acc[d] += p[j] * rows[j][d];
#endif
}

struct Item {
    int64_t work, kv_head, tok_begin, tok_end;
};

template <typename T>
void attend(const Item& item, const T* q, const T* k_cache, const T* v_cache, T* out,
            const int64_t* q_start, const int64_t* q_len, const int64_t* ctx_len,
            const int64_t* block_tables, int64_t table_stride, int64_t H, int64_t H_kv,
            int64_t D, int64_t B, int64_t window, float scale) {
    const int64_t G = H / H_kv;
    const int64_t w = item.work, h = item.kv_head;
    const int64_t rows = (item.tok_end - item.tok_begin) * G;
    const int64_t first_pos = ctx_len[w] - q_len[w];
    const int64_t* table = block_tables + w * table_stride;
    const int64_t block_stride = B * H_kv * D, token_stride = H_kv * D;

    alignas(64) float qf[MAX_ROWS][MAX_HEAD_DIM];
    alignas(64) float acc[MAX_ROWS][MAX_HEAD_DIM];
    alignas(64) float scores[MAX_ROWS][KEY_CHUNK];
    alignas(64) float converted[sizeof(T) == sizeof(float) ? 1 : KEY_CHUNK][MAX_HEAD_DIM];
    float row_max[MAX_ROWS], row_sum[MAX_ROWS];
    int64_t lo[MAX_ROWS], hi[MAX_ROWS];

    for (int64_t r = 0; r < rows; ++r) {
        const int64_t tok = item.tok_begin + r / G;
        const int64_t head = h * G + r % G;
        const T* src = q + ((q_start[w] + tok) * H + head) * D;
        for (int64_t d = 0; d < D; ++d) qf[r][d] = load(src[d]) * scale;
        for (int64_t d = 0; d < D; ++d) acc[r][d] = 0.0f;
        const int64_t pos = first_pos + tok;
        hi[r] = pos;
        lo[r] = (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;
        row_max[r] = -INFINITY;
        row_sum[r] = 0.0f;
    }
    const int64_t last_pos = first_pos + item.tok_end - 1;
    const int64_t first_tok_pos = first_pos + item.tok_begin;
    const int64_t key_begin =
        (window > 0 && first_tok_pos - window + 1 > 0) ? first_tok_pos - window + 1 : 0;
    const int64_t key_end = last_pos + 1;

    const bool vec = kVector && D % 8 == 0;
    const float* rowp[KEY_CHUNK];
    for (int64_t c0 = key_begin; c0 < key_end; c0 += KEY_CHUNK) {
        const int64_t n = (key_end - c0 < KEY_CHUNK) ? key_end - c0 : KEY_CHUNK;
        key_rows(k_cache, table, c0, n, block_stride, token_stride, h * D, B, D, converted, rowp);
        for (int64_t r = 0; r < rows; ++r) {
            float* sr = scores[r];
            int64_t j = 0;
            if (vec) {
                for (; j + 4 <= n; j += 4)
                    dot4(qf[r], rowp[j], rowp[j + 1], rowp[j + 2], rowp[j + 3], D, sr + j);
                for (; j < n; ++j) sr[j] = dot1(qf[r], rowp[j], D);
            } else {
                for (; j < n; ++j) sr[j] = dot_plain(qf[r], rowp[j], D);
            }
            if (c0 < lo[r] || c0 + n - 1 > hi[r]) {
                for (j = 0; j < n; ++j)
                    if (c0 + j < lo[r] || c0 + j > hi[r]) sr[j] = -INFINITY;
            }
        }
        for (int64_t r = 0; r < rows; ++r) {
            float* sr = scores[r];
            float chunk_max = -INFINITY;
            for (int64_t j = 0; j < n; ++j) chunk_max = sr[j] > chunk_max ? sr[j] : chunk_max;
            if (chunk_max == -INFINITY) {
                for (int64_t j = 0; j < n; ++j) sr[j] = 0.0f;
                continue;
            }
            const float new_max = chunk_max > row_max[r] ? chunk_max : row_max[r];
            if (new_max > row_max[r] && row_max[r] != -INFINITY) {
                const float alpha = exp_nonpositive(row_max[r] - new_max);
                row_sum[r] *= alpha;
                for (int64_t d = 0; d < D; ++d) acc[r][d] *= alpha;
            }
            row_max[r] = new_max;
            float sum = 0.0f;
            if (vec) {
                sum = exp_row(sr, n, new_max);
            } else {
                for (int64_t j = 0; j < n; ++j) {
                    sr[j] = sr[j] == -INFINITY ? 0.0f : exp_nonpositive(sr[j] - new_max);
                    sum += sr[j];
                }
            }
            row_sum[r] += sum;
        }
        key_rows(v_cache, table, c0, n, block_stride, token_stride, h * D, B, D, converted, rowp);
        for (int64_t r = 0; r < rows; ++r) {
            if (vec) {
                accumulate(acc[r], scores[r], rowp, n, D);
            } else {
                for (int64_t j = 0; j < n; ++j)
                    for (int64_t d = 0; d < D; ++d) acc[r][d] += scores[r][j] * rowp[j][d];
            }
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t tok = item.tok_begin + r / G;
        const int64_t head = h * G + r % G;
        T* dst = out + ((q_start[w] + tok) * H + head) * D;
        const float inv = row_sum[r] > 0.0f ? 1.0f / row_sum[r] : 0.0f;
        for (int64_t d = 0; d < D; ++d) store(dst + d, acc[r][d] * inv);
    }
}

template <typename T>
int run(const void* q, const void* k_cache, const void* v_cache, void* out,
        const int64_t* q_start, const int64_t* q_len, const int64_t* ctx_len,
        const int64_t* block_tables, int64_t table_stride, int64_t num_works, int64_t H,
        int64_t H_kv, int64_t D, int64_t B, int64_t window, float scale, int num_threads) {
    if (H_kv <= 0 || H % H_kv != 0 || D > MAX_HEAD_DIM || H / H_kv > MAX_ROWS) return 1;
    const int64_t G = H / H_kv;
    const int64_t tile = MAX_ROWS / G;
    std::vector<Item> items;
    for (int64_t w = 0; w < num_works; ++w) {
        if (q_len[w] < 1 || ctx_len[w] < q_len[w]) return 2;
        for (int64_t t = 0; t < q_len[w]; t += tile) {
            const int64_t end = (t + tile < q_len[w]) ? t + tile : q_len[w];
            for (int64_t h = 0; h < H_kv; ++h) items.push_back({w, h, t, end});
        }
    }
    const int64_t count = int64_t(items.size());
    // Small steps stay on one thread: a parallel region costs more than it saves there, and
    // far more when the machine is oversubscribed (a barrier waits for a descheduled thread).
    int64_t work = 0;
    for (const Item& item : items)
        work += (item.tok_end - item.tok_begin) * G * (ctx_len[item.work] + 1) * D;
    const bool parallel = count > 1 && work >= PARALLEL_MIN_ELEMENTS * 16;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (parallel)
    for (int64_t i = 0; i < count; ++i) {
        attend<T>(items[i], static_cast<const T*>(q), static_cast<const T*>(k_cache),
                  static_cast<const T*>(v_cache), static_cast<T*>(out), q_start, q_len,
                  ctx_len, block_tables, table_stride, H, H_kv, D, B, window, scale);
    }
    return 0;
}

// -- element-wise layer ops, fused: residual add + RMSNorm, SiLU * mul, in-place RoPE -------

template <typename T>
void add_rms_norm(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t dim,
                  float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r) {
        T* res = residual + r * dim;
        float sum = 0.0f;
        if (x != nullptr) {
            const T* xr = x + r * dim;
            for (int64_t d = 0; d < dim; ++d) {
                // the sum is rounded to the model dtype, as the unfused add would
                T v;
                store(&v, load(res[d]) + load(xr[d]));
                res[d] = v;
            }
        }
        for (int64_t d = 0; d < dim; ++d) sum += load(res[d]) * load(res[d]);
        const float inv = 1.0f / std::sqrt(sum / float(dim) + eps);
        T* o = out + r * dim;
        for (int64_t d = 0; d < dim; ++d) store(o + d, load(weight[d]) * (load(res[d]) * inv));
    }
}

template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t rows, int64_t inter, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * inter >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r) {
        const T* g = gate_up + r * 2 * inter;
        const T* u = g + inter;
        T* o = out + r * inter;
        for (int64_t i = 0; i < inter; ++i) {
            const float gv = load(g[i]);
            // silu rounds to the model dtype before the product, as F.silu(g) * u does
            T act;
            store(&act, gv / (1.0f + std::exp(-gv)));
            store(o + i, load(act) * load(u[i]));
        }
    }
}

// x [T, heads, D] (row stride row_stride elements) rotated in place by the half-split
// convention: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin). cos/sin tables hold D columns
// per position: cos in the first half, sin (positive) in the second.
template <typename T>
void rope(T* x, const int64_t* positions, const T* cos_table, const T* sin_table, int64_t tokens,
          int64_t heads, int64_t D, int64_t row_stride, int num_threads) {
    const int64_t half = D / 2;
#pragma omp parallel for num_threads(num_threads) if (tokens * heads * D >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < tokens; ++t) {
        const T* c = cos_table + positions[t] * D;
        const T* s = sin_table + positions[t] * D + half;
        for (int64_t h = 0; h < heads; ++h) {
            T* v = x + t * row_stride + h * D;
            for (int64_t i = 0; i < half; ++i) {
                const float x1 = load(v[i]), x2 = load(v[half + i]);
                const float ci = load(c[i]), si = load(s[i]);
                T a, b, e, f;  // each product rounds to the model dtype, as in transformers
                store(&a, x1 * ci);
                store(&b, x2 * si);
                store(&e, x2 * ci);
                store(&f, x1 * si);
                store(v + i, load(a) - load(b));
                store(v + half + i, load(e) + load(f));
            }
        }
    }
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16. Returns 0 on success, non-zero for unsupported shapes.
int kvpilot_paged_attention(int dtype, const void* q, const void* k_cache, const void* v_cache,
                            void* out, const int64_t* q_start, const int64_t* q_len,
                            const int64_t* ctx_len, const int64_t* block_tables,
                            int64_t table_stride, int64_t num_works, int64_t H, int64_t H_kv,
                            int64_t D, int64_t B, int64_t window, float scale,
                            int num_threads) {
    if (dtype == 0)
        return run<float>(q, k_cache, v_cache, out, q_start, q_len, ctx_len, block_tables,
                          table_stride, num_works, H, H_kv, D, B, window, scale, num_threads);
    if (dtype == 1)
        return run<uint16_t>(q, k_cache, v_cache, out, q_start, q_len, ctx_len, block_tables,
                             table_stride, num_works, H, H_kv, D, B, window, scale,
                             num_threads);
    return 3;
}

int kvpilot_add_rms_norm(int dtype, const void* x, void* residual, const void* weight, void* out,
                         int64_t rows, int64_t dim, float eps, int num_threads) {
    if (dtype == 0)
        add_rms_norm<float>(static_cast<const float*>(x), static_cast<float*>(residual),
                            static_cast<const float*>(weight), static_cast<float*>(out), rows,
                            dim, eps, num_threads);
    else if (dtype == 1)
        add_rms_norm<uint16_t>(static_cast<const uint16_t*>(x), static_cast<uint16_t*>(residual),
                               static_cast<const uint16_t*>(weight), static_cast<uint16_t*>(out),
                               rows, dim, eps, num_threads);
    else
        return 3;
    return 0;
}

int kvpilot_silu_mul(int dtype, const void* gate_up, void* out, int64_t rows, int64_t inter,
                     int num_threads) {
    if (dtype == 0)
        silu_mul<float>(static_cast<const float*>(gate_up), static_cast<float*>(out), rows, inter,
                        num_threads);
    else if (dtype == 1)
        silu_mul<uint16_t>(static_cast<const uint16_t*>(gate_up), static_cast<uint16_t*>(out),
                           rows, inter, num_threads);
    else
        return 3;
    return 0;
}

int kvpilot_rope(int dtype, void* x, const int64_t* positions, const void* cos_table,
                 const void* sin_table, int64_t tokens, int64_t heads, int64_t D,
                 int64_t row_stride, int num_threads) {
    if (D % 2 != 0) return 1;
    if (dtype == 0)
        rope<float>(static_cast<float*>(x), positions, static_cast<const float*>(cos_table),
                    static_cast<const float*>(sin_table), tokens, heads, D, row_stride,
                    num_threads);
    else if (dtype == 1)
        rope<uint16_t>(static_cast<uint16_t*>(x), positions,
                       static_cast<const uint16_t*>(cos_table),
                       static_cast<const uint16_t*>(sin_table), tokens, heads, D, row_stride,
                       num_threads);
    else
        return 3;
    return 0;
}

int kvpilot_kernel_abi_version() { return 2; }
}
