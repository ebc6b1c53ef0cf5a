/* The CPU kernels of blend/cpu_kernels.py, registered as torch custom ops in the `ragblend` namespace
 * (torch.ops.ragblend.*; built by torch.utils.cpp_extension, see that module's docstring):
 *
 *   decode_attention   for each row, the query heads that share a KV head over that row's own keys
 *                      [0, length), read once, in place in the KV pool (float32 or float16 elements)
 *   linear_rows(_many) 1..8 rows times a weight matrix (or several), the weights streamed once by all threads
 *   quantized_rows     the same on weights kept as 8- or 4-bit codes in groups of 32 (GGUF's Q8_0 / Q4_1 forms)
 *   rope_write         RoPE on a decode step's new queries and keys, the keys and values written into the pool
 *   decode_layer       a Llama-shaped decoder layer of a decode step: the kernels above, norms, SiLU, residuals
 *   prefill_attention  causal flash attention of queries at sorted positions over the prompt's keys
 *
 * Each row's result depends on its own inputs only, never on the step's other rows: a request decodes the
 * same tokens alone or batched. Threads come from ATen's intra-op pool (at::parallel_for: in torch's OpenMP
 * build, OpenMP compiled into this file, its calls resolved to the runtime torch loaded); a thread computes each
 * output element in the same order whichever elements it is given. Plain C++ with GCC/Clang vector types, which
 * the compiler maps to the machine's vectors (x86 intrinsics only where a widening or a fused product has no
 * portable form, with the plain code beside them). Built with -ffp-contract=off (the decode
 * linears' sums are the same bits at any row count; the attention kernels fuse theirs, see there) and `omp simd`
 * reductions (the order the vectoriser gives them, kept from build to build). Each op checks what it reads and
 * writes (shapes, strides, dtypes, positions, lengths) before it touches memory, whoever calls it. */
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>
#if defined(__F16C__) || defined(__AVX2__) || defined(__FMA__)
#include <immintrin.h>
#endif

/* Where a section fuses its multiply-adds (the file is built without: -ffp-contract=off) */
#if defined(__clang__)
#define FUSED_PRODUCTS_BEGIN _Pragma("clang fp contract(fast)")
#define FUSED_PRODUCTS_END _Pragma("clang fp contract(off)")
#elif defined(__GNUC__)
#define FUSED_PRODUCTS_BEGIN _Pragma("GCC push_options") _Pragma("GCC optimize(\"fp-contract=fast\")")
#define FUSED_PRODUCTS_END _Pragma("GCC pop_options")
#else
#define FUSED_PRODUCTS_BEGIN
#define FUSED_PRODUCTS_END
#endif

namespace {

typedef float floats8 __attribute__((vector_size(32)));
typedef float floats8_unaligned __attribute__((vector_size(32), aligned(4)));
typedef int32_t ints8 __attribute__((vector_size(32)));

/* Fused multiply-adds in the decode attention (the pool's elements, the attention): every row runs the same code
 * whatever the step's other rows, so its sums keep one order at any row count; a fused product-sum rounds once
 * and halves the arithmetic that bounds the kernel once the pool is float16. */
FUSED_PRODUCTS_BEGIN

/* ---- the decode pool's elements: float32, or float16 (half the bytes a step streams) -----------------------
 * Read 8 (or 1) at a time as floats; written rounded to the nearest half (c10::Half's conversion, torch's). */

static inline floats8 load8(const float *p) { return *(const floats8_unaligned *)p; }
static inline floats8 load8(const at::Half *p) {
#if defined(__F16C__)
    return (floats8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    floats8 out;
    for (int i = 0; i < 8; i++) out[i] = static_cast<float>(p[i]);
    return out;
#endif
}
template <typename T>
static inline void store(T *out, const float *in, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = static_cast<T>(in[i]);
}

/* ---- decode attention ---------------------------------------------------------------------------------
 * Tasks are (row, KV head, CHUNK keys), spread over the threads; each row's chunks are merged in order by
 * their maxima. A task reads each key and value from memory once, widened to floats in registers for up to
 * three query heads of its group at once (float16 elements are never written out as floats); meanwhile it
 * prefetches the next task's, so the memory keeps streaming. */

#define CHUNK 128 /* keys per task: 32 KB of K and of V at head_dim 64 in float32 (half in float16), in L2 */
#define LINE 64   /* bytes in a cache line */

/* A span of memory fetched into the caches a few lines at a time, spread over a task's loop steps. */
typedef struct {
    const char *next, *end;
    int64_t lines_per_step;
} prefetch_span;

static inline prefetch_span span(const void *start, int64_t bytes, int64_t steps) {
    int64_t lines = (bytes + LINE - 1) / LINE;
    return prefetch_span{(const char *)start, (const char *)start + bytes, (lines + steps - 1) / steps};
}

static inline void prefetch_step(prefetch_span *p) {
    for (int64_t i = 0; i < p->lines_per_step && p->next < p->end; i++, p->next += LINE)
        __builtin_prefetch(p->next, 0, 3);
}

/* exp(x) for x <= 0 (scores minus their max), 8 lanes: Cephes' expf polynomial, relative error ~1e-7. */
static inline floats8 exp8_nonpositive(floats8 x) {
    floats8 low = floats8{} - 87.0f; /* exp(-87) ~ 1.6e-38: below it 2^n leaves the floats */
    ints8 below = x < low;
    x = (floats8)(((ints8)x & ~below) | ((ints8)low & below));
    ints8 n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, ints8); /* nearest x / ln 2, as x <= 0 */
    floats8 fn = __builtin_convertvector(n, floats8);
    floats8 r = x - fn * 0.693359375f + fn * 2.12194440e-4f;
    floats8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (floats8)((n + 127) << 23); /* times 2^n, built in the exponent bits */
}

/* The four sums' lanes added together: a0, a1, a2, a3's totals (times scale) into out[0..3]. Halves added
 * (x: a0 | a1, y: a2 | a3), then quarters, then pairs: a0, a2, a1, a3 in lanes 0, 2, 4, 6. */
static inline void sum4(floats8 a0, floats8 a1, floats8 a2, floats8 a3, float scale, float *out) {
    floats8 x = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 8, 9, 10, 11) +
                __builtin_shufflevector(a0, a1, 4, 5, 6, 7, 12, 13, 14, 15);
    floats8 y = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 8, 9, 10, 11) +
                __builtin_shufflevector(a2, a3, 4, 5, 6, 7, 12, 13, 14, 15);
    floats8 z = __builtin_shufflevector(x, y, 0, 1, 8, 9, 4, 5, 12, 13) +
                __builtin_shufflevector(x, y, 2, 3, 10, 11, 6, 7, 14, 15);
    floats8 w = z + __builtin_shufflevector(z, z, 1, 0, 3, 2, 5, 4, 7, 6);
    out[0] = w[0] * scale, out[1] = w[4] * scale, out[2] = w[2] * scale, out[3] = w[6] * scale;
}

/* Scores of G queries q [G, dim] (G ≤ 3) over `count` keys k [count, dim], dim a multiple of 8: scores[g·CHUNK + t].
 * Four keys at a time, each key's vector read (and widened) once for the G queries: 4·G independent sums. */
template <int G, typename T>
static inline __attribute__((always_inline)) void score_keys(const float *q, const T *k, int64_t count,
                                                             const int64_t dim, float scale, float *scores,
                                                             prefetch_span *ahead) {
    int64_t t = 0;
    for (; t + 4 <= count; t += 4) {
        floats8 acc[G][4];
        for (int g = 0; g < G; g++)
            for (int j = 0; j < 4; j++) acc[g][j] = floats8{};
        for (int64_t d = 0; d < dim; d += 8)
            for (int j = 0; j < 4; j++) {
                floats8 kj = load8(k + (t + j) * dim + d);
                for (int g = 0; g < G; g++) acc[g][j] += load8(q + g * dim + d) * kj;
            }
        for (int g = 0; g < G; g++) sum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3], scale, scores + g * CHUNK + t);
        prefetch_step(ahead);
    }
    for (; t < count; t++) /* the last 1..3 keys */
        for (int g = 0; g < G; g++) {
            floats8 acc = floats8{};
            for (int64_t d = 0; d < dim; d += 8) acc += load8(q + g * dim + d) * load8(k + t * dim + d);
            float dot = 0.0f;
            for (int i = 0; i < 8; i++) dot += acc[i];
            scores[g * CHUNK + t] = dot * scale;
        }
}

/* out[g] [W·8] = Σ_t p[g·CHUNK + t] · v[t] [W·8] for G queries, over `count` values rows `dim` apart: G·W sums in
 * registers, each value vector read (and widened) once for the G queries. */
template <int G, int W, typename T>
static inline __attribute__((always_inline)) void weigh_values(const float *p, const T *v, int64_t count,
                                                               const int64_t dim, float *out, int64_t out_stride,
                                                               prefetch_span *ahead) {
    floats8 acc[G][W];
    for (int g = 0; g < G; g++)
        for (int w = 0; w < W; w++) acc[g][w] = floats8{};
    for (int64_t t = 0; t < count; t++) {
        floats8 weight[G];
        for (int g = 0; g < G; g++) weight[g] = floats8{} + p[g * CHUNK + t];
        for (int w = 0; w < W; w++) {
            floats8 vw = load8(v + t * dim + 8 * w);
            for (int g = 0; g < G; g++) acc[g][w] += weight[g] * vw;
        }
        prefetch_step(ahead);
    }
    for (int g = 0; g < G; g++)
        for (int w = 0; w < W; w++) *(floats8_unaligned *)(out + g * out_stride + 8 * w) = acc[g][w];
}

/* One task's G queries (G ≤ 3) of a group, dim a multiple of 8: each query's unnormalised output, max score and
 * sum of exp into part [G, dim + 2] (the layout of attend's parts). */
template <int G, typename T>
static inline __attribute__((always_inline)) void attend_queries(const float *q, const T *k, const T *v,
                                                                 int64_t count, const int64_t dim, float scale,
                                                                 float *part, prefetch_span *ahead_k,
                                                                 prefetch_span *ahead_v) {
    float scores[G * CHUNK] __attribute__((aligned(32)));
    score_keys<G>(q, k, count, dim, scale, scores, ahead_k);
    for (int g = 0; g < G; g++) {
        float *s = scores + g * CHUNK, max = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : max)
        for (int64_t t = 0; t < count; t++) max = s[t] > max ? s[t] : max;
        for (int64_t t = count; t % 8; t++) s[t] = max; /* whole vectors for exp: the padding is never summed */
        for (int64_t t = 0; t < count; t += 8) *(floats8 *)(s + t) = exp8_nonpositive(*(floats8 *)(s + t) - max);
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < count; t++) sum += s[t];
        part[g * (dim + 2) + dim] = max;
        part[g * (dim + 2) + dim + 1] = sum;
    }
    int64_t d = 0; /* the values in blocks of 4 vectors (G·4 sums in registers), then of one */
    for (; d + 32 <= dim; d += 32) weigh_values<G, 4>(scores, v + d, count, dim, part + d, dim + 2, ahead_v);
    for (; d < dim; d += 8) weigh_values<G, 1>(scores, v + d, count, dim, part + d, dim + 2, ahead_v);
}

/* One task: queries q [group, dim] over `count` keys/values k, v [count, dim] (float32 or float16, read as floats).
 * Writes each query's unnormalised output, max score and sum of exp: part [group, dim + 2]. The group's queries
 * three at a time, so each key and value is read from memory once and from cache at most ⌈group/3⌉ times.
 * Prefetches `next_k` and `next_v` (the next task's, `next_bytes` each) over its loops. Inlined with dim a
 * constant for the common head sizes, so the loops over dim unroll. */
template <typename T>
static inline __attribute__((always_inline)) void attend(const float *q, const T *k, const T *v, int64_t count,
                                                         int64_t group, const int64_t dim, float scale, float *part,
                                                         const void *next_k, const void *next_v,
                                                         int64_t next_bytes) {
    int64_t passes = (group + 2) / 3;
    prefetch_span ahead_k = span(next_k, next_bytes, passes * (count / 4 + 1));  /* over the score loops */
    prefetch_span ahead_v = span(next_v, next_bytes, passes * count * ((dim + 31) / 32)); /* the value loops */
    for (int64_t g = 0; g < group; g += 3) {
        const float *qg = q + g * dim;
        float *out = part + g * (dim + 2);
        switch (group - g) {
            case 1: attend_queries<1>(qg, k, v, count, dim, scale, out, &ahead_k, &ahead_v); break;
            case 2: attend_queries<2>(qg, k, v, count, dim, scale, out, &ahead_k, &ahead_v); break;
            default: attend_queries<3>(qg, k, v, count, dim, scale, out, &ahead_k, &ahead_v);
        }
    }
}

/* A head size that is not a multiple of 8: the same sums one element at a time, each product-sum fused (as the
 * vector code's), whatever the compiler makes of the loops. */
template <typename T>
static void attend_any_dim(const float *q, const T *k, const T *v, int64_t count, int64_t group, int64_t dim,
                           float scale, float *part) {
    float scores[CHUNK];
    for (int64_t g = 0; g < group; g++) {
        const float *qg = q + g * dim;
        float *out = part + g * (dim + 2), max = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < count; t++) {
            float dot = 0.0f;
            for (int64_t d = 0; d < dim; d++) dot = std::fma(qg[d], static_cast<float>(k[t * dim + d]), dot);
            scores[t] = dot * scale;
            max = scores[t] > max ? scores[t] : max;
        }
        for (int64_t d = 0; d < dim; d++) out[d] = 0.0f;
        for (int64_t t = 0; t < count; t++) {
            float weight = expf(scores[t] - max);
            sum += weight;
            for (int64_t d = 0; d < dim; d++) out[d] = std::fma(weight, static_cast<float>(v[t * dim + d]), out[d]);
        }
        out[dim] = max;
        out[dim + 1] = sum;
    }
}

template <typename T>
static void attend_chunk(const float *q, const T *k, const T *v, int64_t count, int64_t group, int64_t dim,
                         float scale, float *part, const void *next_k, const void *next_v, int64_t next_bytes) {
    switch (dim) { /* the common head sizes as constants; any other multiple of 8 with dim unknown */
        case 64: attend(q, k, v, count, group, 64, scale, part, next_k, next_v, next_bytes); break;
        case 128: attend(q, k, v, count, group, 128, scale, part, next_k, next_v, next_bytes); break;
        default:
            if (dim % 8 == 0) attend(q, k, v, count, group, dim, scale, part, next_k, next_v, next_bytes);
            else attend_any_dim(q, k, v, count, group, dim, scale, part);
    }
}

/* Task `task`'s row, KV head, first key and key count, from first [rows + 1] (each row's first task). */
typedef struct {
    int64_t row, head, start, count;
} task_keys;

static inline task_keys task_at(int64_t task, const int64_t *first, const int64_t *lengths, int64_t heads) {
    int64_t r = 0;
    while (first[r + 1] <= task) r++;
    int64_t chunks = (first[r + 1] - first[r]) / heads, start = (task - first[r]) % chunks * CHUNK;
    return task_keys{r, (task - first[r]) / chunks, start, lengths[r] - start < CHUNK ? lengths[r] - start : CHUNK};
}

/* q, out [rows, heads, group, dim] contiguous. Row r, KV head h of k at k + r*k_row + h*k_head, its keys
 * dim floats apart (v likewise); lengths [rows]: keys per row (0: a padding row, output zeros). */
template <typename T>
void decode_attention_kernel(const float *q, const T *k, const T *v, const int64_t *lengths, float *out,
                             int64_t rows, int64_t heads, int64_t group, int64_t dim, int64_t k_row,
                             int64_t k_head, int64_t v_row, int64_t v_head, float scale) {
    auto first = std::make_unique_for_overwrite<int64_t[]>(rows + 1); /* row r's tasks: [first[r], first[r + 1]) */
    first[0] = 0;
    for (int64_t r = 0; r < rows; r++) first[r + 1] = first[r] + heads * ((lengths[r] + CHUNK - 1) / CHUNK);
    int64_t tasks = first[rows], width = group * (dim + 2);
    auto parts = std::make_unique_for_overwrite<float[]>(tasks * width);

    /* each thread takes a run of consecutive tasks: the next one is usually this thread's own */
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; task++) {
            task_keys t = task_at(task, first.get(), lengths, heads);
            task_keys n = task + 1 < tasks ? task_at(task + 1, first.get(), lengths, heads) : task_keys{0, 0, 0, 0};
            attend_chunk(q + (t.row * heads + t.head) * group * dim,
                         k + t.row * k_row + t.head * k_head + t.start * dim,
                         v + t.row * v_row + t.head * v_head + t.start * dim, t.count, group, dim, scale,
                         parts.get() + task * width, k + n.row * k_row + n.head * k_head + n.start * dim,
                         v + n.row * v_row + n.head * v_head + n.start * dim,
                         n.count * dim * (int64_t)sizeof(T));
        }
    });

    at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
        for (int64_t rh = begin; rh < end; rh++) {
            int64_t r = rh / heads, h = rh % heads, chunks = (first[r + 1] - first[r]) / heads;
            const float *row_parts = parts.get() + (first[r] + h * chunks) * width;
            for (int64_t g = 0; g < group; g++) {
                float *o = out + (rh * group + g) * dim, max = -INFINITY, sum = 0.0f;
                for (int64_t d = 0; d < dim; d++) o[d] = 0.0f;
                for (int64_t c = 0; c < chunks; c++) {
                    float m = row_parts[c * width + g * (dim + 2) + dim];
                    max = m > max ? m : max;
                }
                for (int64_t c = 0; c < chunks; c++) {
                    const float *part = row_parts + c * width + g * (dim + 2);
                    float weight = expf(part[dim] - max);
                    sum += weight * part[dim + 1];
                    for (int64_t d = 0; d < dim; d++) o[d] += weight * part[d];
                }
                if (sum > 0.0f)
                    for (int64_t d = 0; d < dim; d++) o[d] /= sum;
            }
        }
    });
}

FUSED_PRODUCTS_END

/* ---- RoPE and the pool write ------------------------------------------------------------------------
 * A decode step's new tokens after their projections: RoPE on each row's query and key heads in HF's
 * rotate-half form, x·cos + rotate_half(x)·sin, as the same float operations (a product, a product of the
 * negated or plain other half, their sum; built with -ffp-contract=off), so the same bits as HF's ops. */

static inline void rope_head(const float *x, const float *cos, const float *sin, float *out, int64_t dim) {
    int64_t half = dim / 2;
    for (int64_t i = 0; i < half; i++) out[i] = x[i] * cos[i] + (-x[i + half]) * sin[i];
    for (int64_t i = half; i < dim; i++) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

/* Row r (slot r of the pool's layer): its query heads q + r*q_row [q_heads, dim] rotated into q_out
 * [rows, q_heads, dim]; its key heads k + r*kv_row rotated and its value heads v + r*kv_row stored (rounded to
 * the pool's elements) into pool_k / pool_v at position positions[r] (head h at r*slot_stride + h*head_stride +
 * position*dim). cos, sin [rows, dim]. */
template <typename T>
void rope_write_kernel(const float *q, const float *k, const float *v, const float *cos, const float *sin,
                       const int64_t *positions, float *q_out, T *pool_k, T *pool_v, int64_t rows, int64_t q_heads,
                       int64_t kv_heads, int64_t dim, int64_t q_row, int64_t kv_row, int64_t slot_stride,
                       int64_t head_stride) {
    std::vector<float> rotated(dim);
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * dim, *s = sin + r * dim;
        for (int64_t h = 0; h < q_heads; h++)
            rope_head(q + r * q_row + h * dim, c, s, q_out + (r * q_heads + h) * dim, dim);
        for (int64_t h = 0; h < kv_heads; h++) {
            int64_t at = r * slot_stride + h * head_stride + positions[r] * dim;
            rope_head(k + r * kv_row + h * dim, c, s, rotated.data(), dim);
            store(pool_k + at, rotated.data(), dim);
            store(pool_v + at, v + r * kv_row + h * dim, dim);
        }
    }
}

/* ---- few-row linears ---------------------------------------------------------------------------------- */

/* out[r·ld + o] = x [R, k] · w[o] for the outputs o in [lo, hi) of w [n, k]: one running sum per (row, output)
 * over k, in the same order whatever R is, so a row's result does not depend on the other rows of the step. */
static inline __attribute__((always_inline)) void linear_range(const float *x, const float *w, float *out,
                                                               int64_t ld, int64_t lo, int64_t hi, int64_t k,
                                                               const int R) {
    for (int64_t o = lo; o < hi; o++) {
        const float *wo = w + o * k;
        floats8 acc[R];
        for (int r = 0; r < R; r++) acc[r] = floats8{};
        int64_t d = 0;
        for (; d + 8 <= k; d += 8) {
            floats8 wd = *(const floats8_unaligned *)(wo + d);
            for (int r = 0; r < R; r++) acc[r] += wd * *(const floats8_unaligned *)(x + r * k + d);
        }
        for (int r = 0; r < R; r++) {
            float sum = 0.0f;
            for (int i = 0; i < 8; i++) sum += acc[r][i];
            for (int64_t t = d; t < k; t++) sum += wo[t] * x[r * k + t];
            out[r * ld + o] = sum;
        }
    }
}

/* out [rows, Σ n] = x [rows, k] · [w[0]; w[1]; ..]ᵀ for `count` matrices w[m] [n[m], k] (a layer's projections of
 * one input, wherever each lies in memory), 1..8 rows (a decode step's): matrix m's outputs in the columns after
 * the matrices before it. The weights are streamed from memory once by all threads, each thread taking an equal
 * run of the outputs as if the matrices were one (one long stream, not a piece of each matrix). MKL runs one row
 * as a GEMV on one thread, a few as a GEMM packed for many. */
void linear_rows_kernel(const float *x, const float *const *w, const int64_t *n, int64_t count, float *out,
                        int64_t rows, int64_t k) {
    int64_t total = 0, team = at::get_num_threads();
    for (int64_t m = 0; m < count; m++) total += n[m];
    at::parallel_for(0, team, 1, [&](int64_t first_member, int64_t end_member) {
        for (int64_t me = first_member; me < end_member; me++) {
            int64_t begin = total * me / team, end = total * (me + 1) / team, offset = 0; /* this member's outputs */
            for (int64_t m = 0; m < count; offset += n[m], m++) {
                int64_t lo = (begin > offset ? begin : offset) - offset;
                int64_t hi = (end < offset + n[m] ? end : offset + n[m]) - offset;
                if (lo >= hi) continue;
                switch (rows) { /* the row count as a constant: the accumulators stay in registers */
                    case 1: linear_range(x, w[m], out + offset, total, lo, hi, k, 1); break;
                    case 2: linear_range(x, w[m], out + offset, total, lo, hi, k, 2); break;
                    case 3: linear_range(x, w[m], out + offset, total, lo, hi, k, 3); break;
                    case 4: linear_range(x, w[m], out + offset, total, lo, hi, k, 4); break;
                    case 5: linear_range(x, w[m], out + offset, total, lo, hi, k, 5); break;
                    case 6: linear_range(x, w[m], out + offset, total, lo, hi, k, 6); break;
                    case 7: linear_range(x, w[m], out + offset, total, lo, hi, k, 7); break;
                    default: linear_range(x, w[m], out + offset, total, lo, hi, k, 8); break;
                }
            }
        }
    });
}

/* ---- few-row linears on quantised weights --------------------------------------------------------------
 * The same product as linear_rows on weights kept as codes in groups of QGROUP along the input (GGUF's own
 * block size), each group's weights w = scale·q (8-bit: q a signed byte) or scale·q + min (4-bit: q 0..15, two
 * a byte: byte j of a group holds its element j in the low nibble, element j + 16 in the high one). A step then
 * streams a byte or half a byte (and the scales) per weight instead of four. Per (row, output): one vector sum
 * per group, scaled and added to the row's running vector in group order; the 4-bit mins' part, min·Σx over the
 * group (the row's group sums, computed once a call), summed likewise: a row's result never depends on the others. */

#define QGROUP 32
typedef int8_t bytes8 __attribute__((vector_size(8), aligned(1)));
typedef uint8_t ubytes8 __attribute__((vector_size(8), aligned(1)));

/* A group's 32 codes as four vectors of 8 floats (elements 0-7, 8-15, 16-23, 24-31). GCC turns the generic
 * byte-to-float conversion into one scalar insert per byte; AVX2 widens 8 bytes in one instruction. */
#if defined(__AVX2__)
#include <immintrin.h>
static inline floats8 widen_signed(const int8_t *c) {
    return (floats8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)c)));
}
template <bool FOUR_BITS>
static inline void decode_group(const uint8_t *code, int64_t g, floats8 &q0, floats8 &q1, floats8 &q2, floats8 &q3) {
    if (FOUR_BITS) { /* bytes 0-7 and 8-15 widened to 32 bits, then split: low nibbles 0-15, high ones 16-31 */
        const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(code + g * 16)));
        const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(code + g * 16 + 8)));
        const __m256i nibble = _mm256_set1_epi32(15);
        q0 = (floats8)_mm256_cvtepi32_ps(_mm256_and_si256(b0, nibble));
        q1 = (floats8)_mm256_cvtepi32_ps(_mm256_and_si256(b1, nibble));
        q2 = (floats8)_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
        q3 = (floats8)_mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
    } else {
        const int8_t *c = (const int8_t *)code + g * QGROUP;
        q0 = widen_signed(c), q1 = widen_signed(c + 8), q2 = widen_signed(c + 16), q3 = widen_signed(c + 24);
    }
}
#else
static inline floats8 widen(bytes8 b) { return __builtin_convertvector(__builtin_convertvector(b, ints8), floats8); }
static inline floats8 widen(ubytes8 b) { return __builtin_convertvector(__builtin_convertvector(b, ints8), floats8); }
template <bool FOUR_BITS>
static inline void decode_group(const uint8_t *code, int64_t g, floats8 &q0, floats8 &q1, floats8 &q2, floats8 &q3) {
    if (FOUR_BITS) {
        ubytes8 b0 = *(const ubytes8 *)(code + g * 16), b1 = *(const ubytes8 *)(code + g * 16 + 8);
        q0 = widen((ubytes8)(b0 & 15)), q1 = widen((ubytes8)(b1 & 15));
        q2 = widen((ubytes8)(b0 >> 4)), q3 = widen((ubytes8)(b1 >> 4));
    } else {
        const int8_t *c = (const int8_t *)code + g * QGROUP;
        q0 = widen(*(const bytes8 *)c), q1 = widen(*(const bytes8 *)(c + 8));
        q2 = widen(*(const bytes8 *)(c + 16)), q3 = widen(*(const bytes8 *)(c + 24));
    }
}
#endif

/* a·b + c, fused where the CPU has it: the codes' products are bound by the arithmetic, not by the memory (a
 * row's sums keep one order at any row count: each row's are the same instructions) */
static inline floats8 multiply_add(floats8 a, floats8 b, floats8 c) {
#if defined(__FMA__)
    return (floats8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

static inline floats8 group_dot(const float *x, floats8 q0, floats8 q1, floats8 q2, floats8 q3) {
    floats8 sum = q0 * *(const floats8_unaligned *)x;
    sum = multiply_add(q1, *(const floats8_unaligned *)(x + 8), sum);
    sum = multiply_add(q2, *(const floats8_unaligned *)(x + 16), sum);
    return multiply_add(q3, *(const floats8_unaligned *)(x + 24), sum);
}

/* out[r·ld + o] for the outputs o in [lo, hi) of codes [n, k] (bytes8) or [n, k/2] (4-bit), scales and mins
 * [n, k/QGROUP]; sums [R, k/QGROUP] the rows' group sums (4-bit only). */
template <bool FOUR_BITS>
static inline __attribute__((always_inline)) void quantized_range(const float *x, const void *codes,
                                                                  const float *scales, const float *mins,
                                                                  const float *sums, float *out, int64_t ld,
                                                                  int64_t lo, int64_t hi, int64_t k, const int R) {
    const int64_t groups = k / QGROUP, row_bytes = FOUR_BITS ? k / 2 : k;
    for (int64_t o = lo; o < hi; o++) {
        const uint8_t *code = (const uint8_t *)codes + o * row_bytes;
        const float *scale = scales + o * groups;
        floats8 acc[R];
        float offset[R];
        for (int r = 0; r < R; r++) acc[r] = floats8{}, offset[r] = 0.0f;
        for (int64_t g = 0; g < groups; g++) {
            floats8 q0, q1, q2, q3;
            decode_group<FOUR_BITS>(code, g, q0, q1, q2, q3);
            for (int r = 0; r < R; r++)
                acc[r] = multiply_add(group_dot(x + r * k + g * QGROUP, q0, q1, q2, q3), floats8{} + scale[g], acc[r]);
        }
        if (FOUR_BITS) /* the mins' part: Σ_g min·Σx, 8 groups a vector, the rest one by one */
            for (int r = 0; r < R; r++) {
                const float *mn = mins + o * groups, *sm = sums + r * groups;
                floats8 part = floats8{};
                int64_t g = 0;
                for (; g + 8 <= groups; g += 8)
                    part += *(const floats8_unaligned *)(mn + g) * *(const floats8_unaligned *)(sm + g);
                for (int i = 0; i < 8; i++) offset[r] += part[i];
                for (; g < groups; g++) offset[r] += mn[g] * sm[g];
            }
        for (int r = 0; r < R; r++) {
            float sum = 0.0f;
            for (int i = 0; i < 8; i++) sum += acc[r][i];
            out[r * ld + o] = sum + offset[r];
        }
    }
}

/* linear_rows_kernel's split of the outputs over the threads, on `count` quantised matrices of one input. */
template <bool FOUR_BITS>
void quantized_rows_kernel(const float *x, const void *const *codes, const float *const *scales,
                           const float *const *mins, const int64_t *n, int64_t count, float *out, int64_t rows,
                           int64_t k) {
    std::vector<float> sums(FOUR_BITS ? rows * (k / QGROUP) : 0); /* [rows, groups]: Σ x over each group */
    for (int64_t r = 0; FOUR_BITS && r < rows; r++)
        for (int64_t g = 0; g < k / QGROUP; g++) {
            float sum = 0.0f;
            for (int64_t t = 0; t < QGROUP; t++) sum += x[r * k + g * QGROUP + t];
            sums[r * (k / QGROUP) + g] = sum;
        }
    int64_t total = 0, team = at::get_num_threads();
    for (int64_t m = 0; m < count; m++) total += n[m];
    at::parallel_for(0, team, 1, [&](int64_t first_member, int64_t end_member) {
        for (int64_t me = first_member; me < end_member; me++) {
            int64_t begin = total * me / team, end = total * (me + 1) / team, offset = 0; /* this member's outputs */
            for (int64_t m = 0; m < count; offset += n[m], m++) {
                int64_t lo = (begin > offset ? begin : offset) - offset;
                int64_t hi = (end < offset + n[m] ? end : offset + n[m]) - offset;
                if (lo >= hi) continue;
                const float *mn = FOUR_BITS ? mins[m] : nullptr;
#define ROWS(R) quantized_range<FOUR_BITS>(x, codes[m], scales[m], mn, sums.data(), out + offset, total, lo, hi, k, R)
                switch (rows) { /* the row count as a constant: the accumulators stay in registers */
                    case 1: ROWS(1); break;
                    case 2: ROWS(2); break;
                    case 3: ROWS(3); break;
                    case 4: ROWS(4); break;
                    case 5: ROWS(5); break;
                    case 6: ROWS(6); break;
                    case 7: ROWS(7); break;
                    default: ROWS(8); break;
                }
#undef ROWS
            }
        }
    });
}

/* ---- prefill attention ---------------------------------------------------------------------------------
 * Queries at sorted absolute positions (a blended prefill's recomputed tokens and question, or any run of
 * them) over the prompt's keys, each query seeing the keys at or before its position. Flash attention on
 * the CPU: tasks of (KV head, QROWS query positions × the group's query heads), each walking the key blocks
 * its queries see with a running max and sum per query; S = Q·Kᵀ and O += P·V as register-tiled products.
 * K is first laid out transposed, a block at a time ([heads, blocks, dim, KBLOCK]), so S's tiles load 8
 * keys' values of one dimension as one vector. */

/* Fused multiply-adds from here on: a prefill runs alone, so no other row's count can change its sums' order
 * (the reason the file is built without them), and they halve the products' instructions. */
FUSED_PRODUCTS_BEGIN

#define QROWS 32  /* query positions per task: each task reads the K/V its queries see once */
#define KBLOCK 64 /* keys per block: S's row and Kᵀ's block stay in L1 */
/* Loaded once into registers for the R products that use them (the compiler would reload them from L1 for
 * each product, and the loads, not the arithmetic, would bound the tile). */
#if defined(__x86_64__) || defined(__i386__)
#define IN_REGISTERS(a, b) __asm__("" : "+x"(a), "+x"(b))
#elif defined(__aarch64__)
#define IN_REGISTERS(a, b) __asm__("" : "+w"(a), "+w"(b))
#else
#define IN_REGISTERS(a, b) ((void)0)
#endif
#define TILE 6    /* query vectors per register tile: 12 accumulators, 2 key (value) vectors, 1 broadcast */

/* acc0[r], acc1[r] += Σ_t a[r·a_row + t] · b[t·b_row + 0:16] for t < inner: R rows of a, one element at a time
 * broadcast, against 16 columns of b. S = Q·Kᵀ and O += P·V are both made of these tiles. */
static inline __attribute__((always_inline)) void tile_product(const float *a, int64_t a_row, const float *b,
                                                               int64_t b_row, int64_t inner, floats8 *acc0,
                                                               floats8 *acc1, const int R) {
    for (int64_t t = 0; t < inner; t++) {
        floats8 b0 = *(const floats8_unaligned *)(b + t * b_row);
        floats8 b1 = *(const floats8_unaligned *)(b + t * b_row + 8);
        IN_REGISTERS(b0, b1);
        for (int r = 0; r < R; r++) {
            float x = a[r * a_row + t];
            acc0[r] += x * b0;
            acc1[r] += x * b1;
        }
    }
}

/* S[m, 0:KBLOCK] = Q[m] · Kᵀ block for rows m0..m0+R of the tile, 16 keys at a time. */
static inline __attribute__((always_inline)) void scores_tile(const float *qs, const float *kt, float *s,
                                                              const int64_t dim, const int R) {
    for (int j = 0; j < KBLOCK; j += 16) {
        floats8 acc0[R], acc1[R];
        for (int r = 0; r < R; r++) acc0[r] = acc1[r] = floats8{};
        tile_product(qs, dim, kt + j, KBLOCK, dim, acc0, acc1, R);
        for (int r = 0; r < R; r++) {
            *(floats8 *)(s + r * KBLOCK + j) = acc0[r];
            *(floats8 *)(s + r * KBLOCK + j + 8) = acc1[r];
        }
    }
}

/* O[m] = O[m] · alpha[m] + P[m, 0:count] · V[0:count] for rows m0..m0+R of the tile, 16 dimensions at a time. */
static inline __attribute__((always_inline)) void values_tile(const float *p, const float *v, const float *alpha,
                                                              float *o, int64_t count, const int64_t dim,
                                                              const int R) {
    for (int64_t i = 0; i < dim; i += 16) {
        floats8 acc0[R], acc1[R];
        for (int r = 0; r < R; r++) {
            acc0[r] = *(const floats8 *)(o + r * dim + i) * alpha[r];
            acc1[r] = *(const floats8 *)(o + r * dim + i + 8) * alpha[r];
        }
        tile_product(p, KBLOCK, v + i, dim, count, acc0, acc1, R);
        for (int r = 0; r < R; r++) {
            *(floats8 *)(o + r * dim + i) = acc0[r];
            *(floats8 *)(o + r * dim + i + 8) = acc1[r];
        }
    }
}

/* One task: the M query vectors qs [M, dim] (scaled), at positions pos [M] (sorted), over key blocks
 * kt [blocks, dim, KBLOCK] and values v [T, dim]; writes o [M, dim] normalised. s [M, KBLOCK], mx and l [M]
 * are the caller's scratch. */
static inline __attribute__((always_inline)) void prefill_task(const float *qs, const int64_t *pos, int64_t M,
                                                               const float *kt, const float *v, float *s,
                                                               float *o, float *mx, float *l, float *alpha,
                                                               const int64_t dim) {
    for (int64_t m = 0; m < M * dim; m++) o[m] = 0.0f;
    for (int64_t m = 0; m < M; m++) mx[m] = -INFINITY, l[m] = 0.0f;
    int64_t first = 0; /* the first query vector that sees the current block: the earlier ones see none of it */
    for (int64_t kb = 0; kb <= pos[M - 1]; kb += KBLOCK) {
        while (pos[first] < kb) first++;
        const float *ktb = kt + kb / KBLOCK * dim * KBLOCK;
        int64_t m = first;
        for (; m + TILE <= M; m += TILE) scores_tile(qs + m * dim, ktb, s + m * KBLOCK, dim, TILE);
        switch (M - m) { /* the rows left, as one tile of a constant size */
            case 5: scores_tile(qs + m * dim, ktb, s + m * KBLOCK, dim, 5); break;
            case 4: scores_tile(qs + m * dim, ktb, s + m * KBLOCK, dim, 4); break;
            case 3: scores_tile(qs + m * dim, ktb, s + m * KBLOCK, dim, 3); break;
            case 2: scores_tile(qs + m * dim, ktb, s + m * KBLOCK, dim, 2); break;
            case 1: scores_tile(qs + m * dim, ktb, s + m * KBLOCK, dim, 1); break;
        }
        int64_t count = 0; /* keys of this block any query sees */
        for (m = first; m < M; m++) {
            float *row = s + m * KBLOCK;
            int64_t seen = pos[m] - kb + 1 < KBLOCK ? pos[m] - kb + 1 : KBLOCK;
            count = seen > count ? seen : count;
            for (int64_t t = seen; t < KBLOCK; t++) row[t] = -INFINITY; /* keys after the query's position */
            floats8 top = *(floats8 *)row;
            for (int64_t t = 8; t < KBLOCK; t += 8) {
                floats8 x = *(floats8 *)(row + t);
                ints8 above = x > top;
                top = (floats8)(((ints8)x & above) | ((ints8)top & ~above));
            }
            float row_max = mx[m];
            for (int i = 0; i < 8; i++) row_max = top[i] > row_max ? top[i] : row_max;
            floats8 sum = {0};
            for (int64_t t = 0; t < KBLOCK; t += 8) {
                floats8 x = *(floats8 *)(row + t);
                floats8 p = (floats8)((ints8)exp8_nonpositive(x - row_max) & (x != -INFINITY)); /* exp(-inf): 0 */
                *(floats8 *)(row + t) = p;
                sum += p;
            }
            alpha[m] = expf(mx[m] - row_max); /* 0 at the first block a query sees */
            l[m] = l[m] * alpha[m] + (sum[0] + sum[4]) + (sum[1] + sum[5]) + (sum[2] + sum[6]) + (sum[3] + sum[7]);
            mx[m] = row_max;
        }
        const float *vb = v + kb * dim;
        for (m = first; m + TILE <= M; m += TILE)
            values_tile(s + m * KBLOCK, vb, alpha + m, o + m * dim, count, dim, TILE);
        switch (M - m) {
            case 5: values_tile(s + m * KBLOCK, vb, alpha + m, o + m * dim, count, dim, 5); break;
            case 4: values_tile(s + m * KBLOCK, vb, alpha + m, o + m * dim, count, dim, 4); break;
            case 3: values_tile(s + m * KBLOCK, vb, alpha + m, o + m * dim, count, dim, 3); break;
            case 2: values_tile(s + m * KBLOCK, vb, alpha + m, o + m * dim, count, dim, 2); break;
            case 1: values_tile(s + m * KBLOCK, vb, alpha + m, o + m * dim, count, dim, 1); break;
        }
    }
    for (int64_t m = 0; m < M; m++)
        for (int64_t d = 0; d < dim; d++) o[m * dim + d] /= l[m];
}

static void prefill_task_dim(const float *qs, const int64_t *pos, int64_t M, const float *kt, const float *v,
                             float *s, float *o, float *mx, float *l, float *alpha, int64_t dim) {
    switch (dim) { /* as attend_chunk: the common head sizes as constants */
        case 64: prefill_task(qs, pos, M, kt, v, s, o, mx, l, alpha, 64); break;
        case 128: prefill_task(qs, pos, M, kt, v, s, o, mx, l, alpha, 128); break;
        default: prefill_task(qs, pos, M, kt, v, s, o, mx, l, alpha, dim);
    }
}

/* Queries q (query head h·group + g at q + (h·group + g)·q_head, position t's row at + t·q_row, dim floats) at
 * sorted positions [tq] over keys/values k, v (KV head h at k + h·k_head, its keys dim floats apart, at least
 * positions[tq - 1] + 1 of them); out [tq, heads·group, dim] contiguous. dim a multiple of 16. */
void prefill_attention_kernel(const float *q, const float *k, const float *v, const int64_t *positions, float *out,
                              int64_t tq, int64_t heads, int64_t group, int64_t dim, int64_t q_head, int64_t q_row,
                              int64_t k_head, int64_t v_head, float scale) {
    int64_t keys = positions[tq - 1] + 1, blocks = (keys + KBLOCK - 1) / KBLOCK;
    int64_t row_blocks = (tq + QROWS - 1) / QROWS, tasks = heads * row_blocks, width = QROWS * group;
    at::Tensor kt_buffer = at::empty({heads * blocks * dim * KBLOCK}, at::kFloat); /* 64-byte aligned */
    float *kt = kt_buffer.data_ptr<float>();
    at::parallel_for(0, heads * blocks, 1, [&](int64_t begin, int64_t end) {
        for (int64_t hb = begin; hb < end; hb++) { /* Kᵀ a block at a time, zeros past the last key */
            const float *kh = k + hb / blocks * k_head;
            int64_t kb = hb % blocks * KBLOCK;
            float *dst = kt + hb * dim * KBLOCK;
            for (int64_t t = 0; t < KBLOCK; t++)
                for (int64_t d = 0; d < dim; d++) dst[d * KBLOCK + t] = kb + t < keys ? kh[(kb + t) * dim + d] : 0.0f;
        }
    });
    /* per worker: the task's query vectors, scores, output, and per-vector max, sum, rescale (aligned vectors
     * of 8), and positions */
    int64_t workers = at::get_num_threads(), floats = (width * (2 * dim + KBLOCK + 3) + 15) / 16 * 16;
    at::Tensor scratch_buffer = at::empty({workers, floats}, at::kFloat);
    float *scratch = scratch_buffer.data_ptr<float>();
    std::vector<int64_t> query_positions(workers * width);
    std::atomic<int64_t> next_task{0}; /* tasks handed out one at a time, in order, to whichever worker is free */
    at::parallel_for(0, workers, 1, [&](int64_t first_worker, int64_t end_worker) {
        for (int64_t worker = first_worker; worker < end_worker; worker++) {
            float *qs = scratch + worker * floats, *o = qs + width * dim, *s = o + width * dim;
            float *mx = s + width * KBLOCK, *l = mx + width, *alpha = l + width;
            int64_t *pos = query_positions.data() + worker * width;
            for (int64_t task; (task = next_task.fetch_add(1)) < tasks;) {
                /* the later rows see the most keys: they go first, so the workers end together */
                int64_t h = task % heads, t0 = (row_blocks - 1 - task / heads) * QROWS;
                int64_t rows = tq - t0 < QROWS ? tq - t0 : QROWS, M = rows * group;
                for (int64_t t = 0; t < rows; t++)
                    for (int64_t g = 0; g < group; g++) {
                        const float *src = q + (h * group + g) * q_head + (t0 + t) * q_row;
                        float *dst = qs + (t * group + g) * dim;
                        for (int64_t d = 0; d < dim; d++) dst[d] = src[d] * scale;
                        pos[t * group + g] = positions[t0 + t];
                    }
                prefill_task_dim(qs, pos, M, kt + h * blocks * dim * KBLOCK, v + h * v_head, s, o, mx, l, alpha,
                                 dim);
                for (int64_t t = 0; t < rows; t++)
                    for (int64_t g = 0; g < group; g++) {
                        const float *src = o + (t * group + g) * dim;
                        float *dst = out + ((t0 + t) * heads * group + h * group + g) * dim;
                        for (int64_t d = 0; d < dim; d++) dst[d] = src[d];
                    }
            }
        }
    });
}

FUSED_PRODUCTS_END

/* ---- the ops: what each kernel reads and writes checked, then the kernel ---------------------------------- */

constexpr int64_t LINEAR_ROWS = 8;            /* linear_rows takes 1..this many rows (linear_range's R) */
constexpr int64_t PREFILL_DIM_MULTIPLE = 16;  /* prefill_attention's head sizes: tiles two vectors of 8 wide */

template <typename... Tensors>
void check_float32(const Tensors &...tensors) {
    TORCH_CHECK_TYPE(((tensors.scalar_type() == at::kFloat && tensors.is_cpu()) && ...),
                     "the CPU kernels take float32 tensors on the CPU");
}

/* The decode pool's keys and values: float32 or float16 on the CPU, both alike. */
void check_pool(const at::Tensor &keys, const at::Tensor &values) {
    TORCH_CHECK_TYPE((keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kHalf) && keys.is_cpu() &&
                         values.scalar_type() == keys.scalar_type() && values.is_cpu(),
                     "the decode pool's keys and values are float32 or float16 on the CPU, both alike: got ",
                     keys.scalar_type(), " and ", values.scalar_type());
}

/* An index tensor (lengths, positions) as int64 [count] on the CPU, to read before the kernel does. */
at::Tensor int64_vector(const at::Tensor &values, int64_t count, const char *name) {
    TORCH_CHECK_VALUE(values.is_cpu() && values.dim() == 1 && values.numel() == count, "expected ", count, " ",
                      name, " on the CPU, got ", values.sizes());
    return values.to(at::kLong).contiguous();
}

float scale_for(std::optional<double> scale, int64_t dim) {
    return static_cast<float>(scale.has_value() ? *scale : std::pow(static_cast<double>(dim), -0.5));
}

at::Tensor decode_attention(const at::Tensor &query, const at::Tensor &keys, const at::Tensor &values,
                            const at::Tensor &lengths, std::optional<double> scale) {
    check_float32(query);
    check_pool(keys, values);
    TORCH_CHECK_VALUE(query.dim() == 4 && keys.dim() == 4 && values.dim() == 4,
                      "decode_attention takes query [rows, Hkv, G, D] and keys, values [rows, Hkv, T, D], got ",
                      query.sizes(), ", ", keys.sizes(), " and ", values.sizes());
    int64_t rows = query.size(0), heads = query.size(1), group = query.size(2), dim = query.size(3);
    TORCH_CHECK_VALUE(keys.stride(2) == dim && keys.stride(3) == 1 && values.stride(2) == dim &&
                          values.stride(3) == 1,
                      "the kernel reads each row's keys as [T, D] rows in place: got strides ", keys.strides(),
                      " and ", values.strides());
    TORCH_CHECK_VALUE(keys.size(0) == rows && keys.size(1) == heads && keys.size(3) == dim &&
                          values.sizes() == keys.sizes(),
                      "decode_attention: query ", query.sizes(), ", keys ", keys.sizes(), " and values ",
                      values.sizes(), " disagree");
    at::Tensor row_lengths = int64_vector(lengths, rows, "lengths");
    const int64_t *length = row_lengths.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; r++) {
        TORCH_CHECK_VALUE(length[r] >= 0, "a row of ", length[r], " keys");
        TORCH_CHECK_VALUE(length[r] <= keys.size(2), "a row of ", length[r], " keys over a view of ", keys.size(2));
    }
    at::Tensor q = query.contiguous(), out = at::empty(q.sizes(), q.options());
    if (keys.scalar_type() == at::kHalf)
        decode_attention_kernel(q.data_ptr<float>(), keys.data_ptr<at::Half>(), values.data_ptr<at::Half>(), length,
                                out.data_ptr<float>(), rows, heads, group, dim, keys.stride(0), keys.stride(1),
                                values.stride(0), values.stride(1), scale_for(scale, dim));
    else
        decode_attention_kernel(q.data_ptr<float>(), keys.data_ptr<float>(), values.data_ptr<float>(), length,
                                out.data_ptr<float>(), rows, heads, group, dim, keys.stride(0), keys.stride(1),
                                values.stride(0), values.stride(1), scale_for(scale, dim));
    return out;
}

at::Tensor linear_rows_many(const at::Tensor &x, at::TensorList weights) {
    TORCH_CHECK_VALUE(x.dim() == 2, "linear rows take x [rows, in], got ", x.sizes());
    int64_t rows = x.size(0), features = x.size(1), total = 0;
    check_float32(x);
    bool fit = 1 <= rows && rows <= LINEAR_ROWS;
    std::vector<const float *> pointers;
    std::vector<int64_t> sizes;
    for (const at::Tensor &weight : weights) {
        check_float32(weight);
        fit = fit && weight.dim() == 2 && weight.size(1) == features && weight.is_contiguous();
        pointers.push_back(weight.data_ptr<float>());
        sizes.push_back(weight.size(0));
        total += weight.size(0);
    }
    if (!fit) {
        std::vector<at::IntArrayRef> shapes;
        for (const at::Tensor &weight : weights) shapes.push_back(weight.sizes());
        TORCH_CHECK_VALUE(false, "linear rows take 1..", LINEAR_ROWS, " rows and contiguous [out, ", features,
                          "] weights, got ", rows, " rows and ", shapes);
    }
    at::Tensor flat = x.contiguous(), out = at::empty({rows, total}, x.options());
    linear_rows_kernel(flat.data_ptr<float>(), pointers.data(), sizes.data(), pointers.size(), out.data_ptr<float>(),
                       rows, features);
    return out;
}

at::Tensor linear_rows(const at::Tensor &x, const at::Tensor &weight) { return linear_rows_many(x, {weight}); }

/* x [rows, k] times quantised matrices of one input (quantized_range's layout): 8-bit codes int8 [n, k], 4-bit
 * codes uint8 [n, k/2] with `mins`; scales (and mins) float32 [n, k/QGROUP]; k a multiple of QGROUP. */
at::Tensor quantized_rows(const at::Tensor &x, at::TensorList codes, at::TensorList scales, at::TensorList mins) {
    TORCH_CHECK_VALUE(x.dim() == 2, "linear rows take x [rows, in], got ", x.sizes());
    check_float32(x);
    int64_t rows = x.size(0), features = x.size(1), total = 0, groups = features / QGROUP;
    bool four_bits = !mins.empty();
    bool fit = 1 <= rows && rows <= LINEAR_ROWS && features % QGROUP == 0 && codes.size() == scales.size() &&
               (!four_bits || mins.size() == codes.size());
    std::vector<const void *> code_pointers;
    std::vector<const float *> scale_pointers, min_pointers;
    std::vector<int64_t> sizes;
    for (size_t m = 0; fit && m < codes.size(); m++) {
        const at::Tensor &code = codes[m], &scale = scales[m];
        int64_t n = code.dim() == 2 ? code.size(0) : -1;
        fit = n > 0 && code.is_cpu() && code.is_contiguous() &&
              code.scalar_type() == (four_bits ? at::kByte : at::kChar) &&
              code.size(1) == (four_bits ? features / 2 : features) && scale.sizes() == at::IntArrayRef{n, groups} &&
              scale.scalar_type() == at::kFloat && scale.is_cpu() && scale.is_contiguous();
        if (fit && four_bits)
            fit = mins[m].sizes() == scale.sizes() && mins[m].scalar_type() == at::kFloat && mins[m].is_cpu() &&
                  mins[m].is_contiguous();
        if (!fit) break;
        code_pointers.push_back(code.data_ptr());
        scale_pointers.push_back(scale.data_ptr<float>());
        min_pointers.push_back(four_bits ? mins[m].data_ptr<float>() : nullptr);
        sizes.push_back(n);
        total += n;
    }
    TORCH_CHECK_VALUE(fit, "quantised linear rows take 1..", LINEAR_ROWS, " rows of a multiple of ", QGROUP,
                      " features and contiguous codes (int8 [out, in], or uint8 [out, in/2] with mins) with float32 "
                      "scales [out, in/", QGROUP, "]: got ", rows, " rows of ", features);
    at::Tensor flat = x.contiguous(), out = at::empty({rows, total}, x.options());
    if (four_bits)
        quantized_rows_kernel<true>(flat.data_ptr<float>(), code_pointers.data(), scale_pointers.data(),
                                    min_pointers.data(), sizes.data(), sizes.size(), out.data_ptr<float>(), rows,
                                    features);
    else
        quantized_rows_kernel<false>(flat.data_ptr<float>(), code_pointers.data(), scale_pointers.data(),
                                     min_pointers.data(), sizes.data(), sizes.size(), out.data_ptr<float>(), rows,
                                     features);
    return out;
}

at::Tensor rope_write(const at::Tensor &query, const at::Tensor &key, const at::Tensor &value, const at::Tensor &cos,
                      const at::Tensor &sin, const at::Tensor &positions, at::Tensor &pool_keys,
                      at::Tensor &pool_values) {
    check_float32(query, key, value, cos, sin);
    check_pool(pool_keys, pool_values);
    TORCH_CHECK_VALUE(cos.dim() == 2 && cos.size(1) % 2 == 0 && sin.sizes() == cos.sizes(),
                      "rope_write takes cos and sin [rows, D], D even: got ", cos.sizes(), " and ", sin.sizes());
    int64_t rows = cos.size(0), dim = cos.size(1);
    bool fit = query.dim() == 2 && key.dim() == 2 && value.sizes() == key.sizes() && pool_keys.dim() == 4 &&
               pool_values.sizes() == pool_keys.sizes();
    int64_t kv_heads = fit ? pool_keys.size(1) : 0, heads = fit ? query.size(1) / dim : 0;
    fit = fit && query.size(0) == rows && key.size(0) == rows && query.size(1) == heads * dim &&
          key.size(1) == kv_heads * dim && query.stride(1) == 1 && key.stride(1) == 1 && value.stride(1) == 1 &&
          key.stride(0) == value.stride(0) && pool_keys.strides() == pool_values.strides() &&
          pool_keys.size(3) == dim && pool_keys.stride(2) == dim && pool_keys.stride(3) == 1 &&
          rows <= pool_keys.size(0);
    TORCH_CHECK_VALUE(fit, "rope_write: query ", query.sizes(), ", key ", key.sizes(), " and pool ", pool_keys.sizes(),
                      " do not fit heads of ", dim);
    at::Tensor where = int64_vector(positions, rows, "positions");
    const int64_t *position = where.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; r++)
        TORCH_CHECK_VALUE(0 <= position[r] && position[r] < pool_keys.size(2), "positions outside the pool's ",
                          pool_keys.size(2), " columns");
    at::Tensor c = cos.contiguous(), s = sin.contiguous(), out = at::empty({rows, heads, dim}, query.options());
    auto write = [&](auto *pool_k, auto *pool_v) {
        rope_write_kernel(query.data_ptr<float>(), key.data_ptr<float>(), value.data_ptr<float>(), c.data_ptr<float>(),
                          s.data_ptr<float>(), position, out.data_ptr<float>(), pool_k, pool_v, rows, heads, kv_heads,
                          dim, query.stride(0), key.stride(0), pool_keys.stride(0), pool_keys.stride(1));
    };
    if (pool_keys.scalar_type() == at::kHalf)
        write(pool_keys.data_ptr<at::Half>(), pool_values.data_ptr<at::Half>());
    else
        write(pool_keys.data_ptr<float>(), pool_values.data_ptr<float>());
    return out;
}

/* ---- one decoder layer of a decode step ------------------------------------------------------------------
 * A Llama-shaped layer (RMSNorm, q/k/v, RoPE, attention over the pool, o, RMSNorm, gate/up, SiLU, down, two
 * residual adds) as one call: the kernels above in turn, and the norms, the activation and the adds as plain
 * loops, so a step makes one call a layer instead of ~60 small torch ops and their Python (~10 of a SmolLM2
 * step's ~28 ms). Each row's result depends on its own inputs only, as in every kernel here. */

/* out [rows, n] = weight · (x / sqrt(mean(x²) + eps)), x [rows, n] (HF's LlamaRMSNorm, float32). */
at::Tensor rms_norm(const at::Tensor &x, const at::Tensor &weight, double eps) {
    int64_t rows = x.size(0), n = x.size(1);
    at::Tensor out = at::empty({rows, n}, x.options());
    const float *in = x.data_ptr<float>(), *w = weight.data_ptr<float>();
    float *o = out.data_ptr<float>();
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = in + r * n;
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < n; i++) squares += xr[i] * xr[i];
        float inverse = 1.0f / std::sqrt(squares / static_cast<float>(n) + static_cast<float>(eps));
        for (int64_t i = 0; i < n; i++) o[r * n + i] = w[i] * (xr[i] * inverse);
    }
    return out;
}

/* [rows, n] = silu(gate) · up, from gate_up [rows, 2n] (gate's columns first; SiLU as x / (1 + e^-x)). */
at::Tensor silu_times(const at::Tensor &gate_up) {
    int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
    at::Tensor out = at::empty({rows, n}, gate_up.options());
    const float *in = gate_up.data_ptr<float>();
    float *o = out.data_ptr<float>();
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < n; i++) {
            float g = in[r * 2 * n + i];
            o[r * n + i] = g / (1.0f + std::exp(-g)) * in[r * 2 * n + n + i];
        }
    return out;
}

/* x [rows, in] times one layer's projections of one input, `weights` in the form of the first tensor's dtype:
 * float32 [w₀, w₁, ..] (linear_rows_many), int8 [codes₀, scales₀, codes₁, ..] or uint8 [codes₀, scales₀, mins₀,
 * codes₁, ..] (quantized_rows); plus `bias` [Σ out] if given. */
at::Tensor projections(const at::Tensor &x, at::TensorList weights, const std::optional<at::Tensor> &bias) {
    TORCH_CHECK_VALUE(!weights.empty(), "a layer's projections need weights");
    at::Tensor out;
    at::ScalarType form = weights[0].scalar_type();
    if (form == at::kFloat) {
        out = linear_rows_many(x, weights);
    } else {
        size_t per = form == at::kByte ? 3 : 2; /* codes, scales (, mins) per matrix */
        TORCH_CHECK_VALUE((form == at::kByte || form == at::kChar) && weights.size() % per == 0,
                          "quantised projections come as (codes, scales) or (codes, scales, mins) per matrix");
        std::vector<at::Tensor> codes, scales, mins;
        for (size_t m = 0; m < weights.size(); m += per) {
            codes.push_back(weights[m]), scales.push_back(weights[m + 1]);
            if (per == 3) mins.push_back(weights[m + 2]);
        }
        out = quantized_rows(x, codes, scales, mins);
    }
    if (bias.has_value()) out.add_(*bias);
    return out;
}

/* hidden [rows, H] → the layer's output [rows, H]; the step's new keys and values written into pool_keys,
 * pool_values [slots, Hkv, columns, D] (rows at slots 0..rows-1, columns `positions`), attention over each row's
 * first lengths[r] keys within the first key_columns. q_size, kv_size: the widths of q and of k (and v) in qkv's
 * output. biases: q/k/v's, o's, gate/up's and down's (each [Σ out] or none). */
at::Tensor decode_layer(const at::Tensor &hidden, const at::Tensor &input_norm, const at::Tensor &post_norm,
                        double eps, at::TensorList qkv, at::TensorList output, at::TensorList gate_up,
                        at::TensorList down, const c10::List<std::optional<at::Tensor>> &biases, int64_t q_size,
                        int64_t kv_size, const at::Tensor &cos, const at::Tensor &sin, const at::Tensor &positions,
                        const at::Tensor &lengths, at::Tensor &pool_keys, at::Tensor &pool_values,
                        int64_t key_columns, double scale) {
    check_float32(hidden, input_norm, post_norm);
    TORCH_CHECK_VALUE(hidden.dim() == 2 && hidden.is_contiguous() && input_norm.dim() == 1 &&
                          input_norm.size(0) == hidden.size(1) && post_norm.sizes() == input_norm.sizes() &&
                          input_norm.is_contiguous() && post_norm.is_contiguous() && biases.size() == 4,
                      "decode_layer takes hidden [rows, H] contiguous, norm weights [H] and four biases: got ",
                      hidden.sizes(), ", ", input_norm.sizes(), " and ", biases.size(), " biases");
    TORCH_CHECK_VALUE(0 < key_columns && key_columns <= pool_keys.size(2), key_columns, " key columns of ",
                      pool_keys.size(2));
    int64_t rows = hidden.size(0);
    at::Tensor qkv_out = projections(rms_norm(hidden, input_norm, eps), qkv, biases.get(0));   /* [rows, Σ out] */
    TORCH_CHECK_VALUE(qkv_out.size(1) == q_size + 2 * kv_size, "q/k/v give ", qkv_out.size(1), " columns, not ",
                      q_size, " + 2 x ", kv_size);
    at::Tensor query = rope_write(qkv_out.narrow(1, 0, q_size), qkv_out.narrow(1, q_size, kv_size),
                                  qkv_out.narrow(1, q_size + kv_size, kv_size), cos, sin, positions, pool_keys,
                                  pool_values);                                                  /* [rows, Hq, D] */
    int64_t kv_heads = pool_keys.size(1), dim = pool_keys.size(3);
    at::Tensor attended = decode_attention(query.view({rows, kv_heads, -1, dim}),
                                           pool_keys.narrow(0, 0, rows).narrow(2, 0, key_columns),
                                           pool_values.narrow(0, 0, rows).narrow(2, 0, key_columns), lengths,
                                           scale);                                          /* [rows, Hkv, G, D] */
    at::Tensor mid = projections(attended.view({rows, -1}), output, biases.get(1)).add_(hidden);  /* [rows, H] */
    at::Tensor gated = silu_times(projections(rms_norm(mid, post_norm, eps), gate_up, biases.get(2)));
    return projections(gated, down, biases.get(3)).add_(mid);                                   /* [rows, H] */
}

at::Tensor prefill_attention(const at::Tensor &query, const at::Tensor &keys, const at::Tensor &values,
                             const at::Tensor &positions, std::optional<double> scale) {
    check_float32(query, keys, values);
    bool fit = query.dim() == 4 && keys.dim() == 4 && values.sizes() == keys.sizes() && query.size(0) == 1 &&
               keys.size(0) == 1 && keys.size(1) > 0 && query.size(1) % keys.size(1) == 0 &&
               keys.size(3) == query.size(3) && query.size(3) % PREFILL_DIM_MULTIPLE == 0;
    TORCH_CHECK_VALUE(fit, "prefill_attention takes one prompt, whole groups of query heads and a head size that is ",
                      "a multiple of ", PREFILL_DIM_MULTIPLE, ": got query ", query.sizes(), ", keys ", keys.sizes());
    int64_t heads = query.size(1), count = query.size(2), dim = query.size(3), kv_heads = keys.size(1);
    TORCH_CHECK_VALUE(query.stride(3) == 1 && keys.stride(2) == dim && keys.stride(3) == 1 && values.stride(2) == dim &&
                          values.stride(3) == 1,
                      "the kernel reads queries, keys and values as rows of D floats in place: got strides ",
                      query.strides(), ", ", keys.strides(), " and ", values.strides());
    TORCH_CHECK_VALUE(positions.is_cpu() && positions.dim() == 1 && positions.numel() == count && count > 0, count,
                      " queries at ", positions.numel(), " positions over ", keys.size(2), " keys");
    at::Tensor sorted = positions.to(at::kLong).contiguous();
    const int64_t *position = sorted.data_ptr<int64_t>();
    TORCH_CHECK_VALUE(position[count - 1] < keys.size(2), count, " queries at ", count, " positions over ",
                      keys.size(2), " keys");
    bool increasing = position[0] >= 0; /* the kernel's tasks read keys up to their last query's position */
    for (int64_t t = 1; t < count; t++) increasing = increasing && position[t] > position[t - 1];
    TORCH_CHECK_VALUE(increasing, "query positions must be non-negative and strictly increasing");
    at::Tensor out = at::empty({1, count, heads, dim}, query.options());
    prefill_attention_kernel(query.data_ptr<float>(), keys.data_ptr<float>(), values.data_ptr<float>(), position,
                             out.data_ptr<float>(), count, kv_heads, heads / kv_heads, dim, query.stride(1),
                             query.stride(2), keys.stride(1), values.stride(1), scale_for(scale, dim));
    return out;
}

/* ---- the int8 codec's round trip of spans, in place (store.codecs.Int8Codec: pack then unpack) -------------
 * Keys: one scale per span and channel (the span's largest |x| in it / 127), values: one per row; an all-zero
 * slice's scale is 1. x -> round half to even (x / scale), clamped to ±127, times the scale: each step one IEEE
 * float32 operation, as torch's ops take them (the file is built without fused multiply-adds), so the same bits.
 * A NaN stays NaN, as through torch's ops. */

static inline float round_trip_one(float x, float scale) {
    float q = std::nearbyint(x / scale);
    if (q > 127.0f) q = 127.0f;
    else if (q < -127.0f) q = -127.0f;
    return q * scale;
}

static inline float int8_scale(float amax) {
    float scale = amax / 127.0f;
    return scale > 0.0f ? scale : 1.0f; /* (NaN > 0 is false: 1, as torch.where(scale > 0, scale, 1)) */
}

static inline float larger_magnitude(float amax, float x) {
    float a = std::fabs(x);
    return std::isnan(amax) || a <= amax ? amax : a; /* a NaN wins, and stays */
}

/* keys, values [1, H, N, D] (rows of D floats), spans [S, 2] (start, end) within N */
void int8_round_trip(at::Tensor &keys, at::Tensor &values, const at::Tensor &spans) {
    check_float32(keys, values);
    TORCH_CHECK_VALUE(keys.dim() == 4 && keys.size(0) == 1 && values.sizes() == keys.sizes() &&
                          keys.stride(3) == 1 && values.stride(3) == 1 && keys.stride(2) == keys.size(3) &&
                          values.stride(2) == values.size(3),
                      "int8_round_trip takes keys and values [1, H, N, D] of rows of D floats: got ", keys.sizes(),
                      " strides ", keys.strides(), " and ", values.sizes(), " strides ", values.strides());
    TORCH_CHECK_VALUE(spans.dim() == 2 && spans.size(1) == 2 && spans.scalar_type() == at::kLong,
                      "spans must be [S, 2] int64 (start, end): got ", spans.sizes());
    at::Tensor bounds = spans.contiguous();
    const int64_t *span = bounds.data_ptr<int64_t>();
    int64_t count = bounds.size(0), heads = keys.size(1), length = keys.size(2), dim = keys.size(3);
    for (int64_t s = 0; s < count; s++)
        TORCH_CHECK_VALUE(0 <= span[2 * s] && span[2 * s] <= span[2 * s + 1] && span[2 * s + 1] <= length, "span [",
                          span[2 * s], ", ", span[2 * s + 1], ") outside the ", length, " rows");
    float *k = keys.data_ptr<float>(), *v = values.data_ptr<float>();
    int64_t k_head = keys.stride(1), v_head = values.stride(1);
    at::parallel_for(0, heads * count, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scales(dim);
        for (int64_t task = begin; task < end; task++) {
            int64_t h = task / count, s = task % count, first = span[2 * s], last = span[2 * s + 1];
            float *kh = k + h * k_head, *vh = v + h * v_head;
            std::fill(scales.begin(), scales.end(), 0.0f);
            for (int64_t t = first; t < last; t++)
                for (int64_t d = 0; d < dim; d++) scales[d] = larger_magnitude(scales[d], kh[t * dim + d]);
            for (int64_t d = 0; d < dim; d++) scales[d] = int8_scale(scales[d]);
            for (int64_t t = first; t < last; t++) {
                float *key = kh + t * dim, *value = vh + t * dim, amax = 0.0f;
                for (int64_t d = 0; d < dim; d++) key[d] = round_trip_one(key[d], scales[d]);
                for (int64_t d = 0; d < dim; d++) amax = larger_magnitude(amax, value[d]);
                float scale = int8_scale(amax);
                for (int64_t d = 0; d < dim; d++) value[d] = round_trip_one(value[d], scale);
            }
        }
    });
}

} // namespace

TORCH_LIBRARY(ragblend, m) {
    m.set_python_module("blend.cpu_kernels"); /* where the fake (shape-only) implementations are registered */
    m.def("decode_attention(Tensor query, Tensor keys, Tensor values, Tensor lengths, float? scale=None) -> Tensor");
    m.def("linear_rows(Tensor x, Tensor weight) -> Tensor");
    m.def("linear_rows_many(Tensor x, Tensor[] weights) -> Tensor");
    m.def("quantized_rows(Tensor x, Tensor[] codes, Tensor[] scales, Tensor[] mins) -> Tensor");
    m.def("rope_write(Tensor query, Tensor key, Tensor value, Tensor cos, Tensor sin, Tensor positions, "
          "Tensor(a!) pool_keys, Tensor(b!) pool_values) -> Tensor");
    m.def("decode_layer(Tensor hidden, Tensor input_norm, Tensor post_norm, float eps, Tensor[] qkv, "
          "Tensor[] output, Tensor[] gate_up, Tensor[] down, Tensor?[] biases, int q_size, int kv_size, Tensor cos, "
          "Tensor sin, Tensor positions, Tensor lengths, Tensor(a!) pool_keys, Tensor(b!) pool_values, "
          "int key_columns, float scale) -> Tensor");
    m.def("prefill_attention(Tensor query, Tensor keys, Tensor values, Tensor positions, float? scale=None) -> Tensor");
    m.def("int8_round_trip(Tensor(a!) keys, Tensor(b!) values, Tensor spans) -> ()");
}

TORCH_LIBRARY_IMPL(ragblend, CPU, m) {
    m.impl("decode_attention", &decode_attention);
    m.impl("linear_rows", &linear_rows);
    m.impl("linear_rows_many", &linear_rows_many);
    m.impl("quantized_rows", &quantized_rows);
    m.impl("rope_write", &rope_write);
    m.impl("decode_layer", &decode_layer);
    m.impl("prefill_attention", &prefill_attention);
    m.impl("int8_round_trip", &int8_round_trip);
}
