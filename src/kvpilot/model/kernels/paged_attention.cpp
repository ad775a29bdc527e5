// Paged attention on the CPU: every query reads its keys and values in place through its
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

namespace {

constexpr int KEY_CHUNK = 128;  // keys scored per online-softmax step
constexpr int MAX_ROWS = 32;    // query rows (tokens x group) per work item
constexpr int MAX_HEAD_DIM = 256;

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

    alignas(64) float kf[MAX_HEAD_DIM];
    for (int64_t c0 = key_begin; c0 < key_end; c0 += KEY_CHUNK) {
        const int64_t n = (key_end - c0 < KEY_CHUNK) ? key_end - c0 : KEY_CHUNK;
        for (int64_t j = 0; j < n; ++j) {
            const int64_t pos = c0 + j;
            const T* kp = k_cache + table[pos / B] * block_stride + (pos % B) * token_stride +
                          h * D;
            for (int64_t d = 0; d < D; ++d) kf[d] = load(kp[d]);
            for (int64_t r = 0; r < rows; ++r) {
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < D; ++d) dot += qf[r][d] * kf[d];
                scores[r][j] = (pos >= lo[r] && pos <= hi[r]) ? dot : -INFINITY;
            }
        }
        for (int64_t r = 0; r < rows; ++r) {
            float chunk_max = -INFINITY;
            for (int64_t j = 0; j < n; ++j) chunk_max = scores[r][j] > chunk_max ? scores[r][j] : chunk_max;
            if (chunk_max == -INFINITY) {
                for (int64_t j = 0; j < n; ++j) scores[r][j] = 0.0f;
                continue;
            }
            const float new_max = chunk_max > row_max[r] ? chunk_max : row_max[r];
            if (new_max > row_max[r] && row_max[r] != -INFINITY) {
                const float alpha = exp_nonpositive(row_max[r] - new_max);
                row_sum[r] *= alpha;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) acc[r][d] *= alpha;
            }
            row_max[r] = new_max;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < n; ++j) {
                const float s = scores[r][j];
                const float p = s == -INFINITY ? 0.0f : exp_nonpositive(s - new_max);
                scores[r][j] = p;
                sum += p;
            }
            row_sum[r] += sum;
        }
        for (int64_t j = 0; j < n; ++j) {
            const int64_t pos = c0 + j;
            const T* vp = v_cache + table[pos / B] * block_stride + (pos % B) * token_stride +
                          h * D;
            for (int64_t d = 0; d < D; ++d) kf[d] = load(vp[d]);
            for (int64_t r = 0; r < rows; ++r) {
                const float p = scores[r][j];
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) acc[r][d] += p * kf[d];
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
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t i = 0; i < count; ++i) {
        attend<T>(items[i], static_cast<const T*>(q), static_cast<const T*>(k_cache),
                  static_cast<const T*>(v_cache), static_cast<T*>(out), q_start, q_len,
                  ctx_len, block_tables, table_stride, H, H_kv, D, B, window, scale);
    }
    return 0;
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

int kvpilot_kernel_abi_version() { return 1; }
}
