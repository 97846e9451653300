#include "model/quant_matmul.h"

#include "model/backends.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#define KVF_QUANT_MATMUL_X86 1
#include <immintrin.h>
#endif

namespace kvf {
namespace {

// ggml's block layouts (ggml-common.h is not installed). Q4_1: 32 weights as 4-bit codes q, each d * q + m.
// Q8_1: 32 activations as int8 codes q, each d * q, and s = d * sum(q). Q8_0: 32 values as int8 codes, d * q.
struct BlockQ4_1 {
    uint16_t d, m;
    uint8_t qs[16];
};
struct BlockQ8_1 {
    uint16_t d, s;
    int8_t qs[32];
};
struct BlockQ8_0 {
    uint16_t d;
    int8_t qs[32];
};
static_assert(sizeof(BlockQ4_1) == 20 && sizeof(BlockQ8_1) == 36 && sizeof(BlockQ8_0) == 34,
              "ggml's Q4_1 / Q8_1 / Q8_0 block layouts");

std::atomic<int> g_mode{-1};

constexpr int k_cols = 8;        // tokens per pass (the lanes of one AVX register of their Q8_1 sums)
constexpr int k_row_chunk = 32;  // weight rows per chunk: a chunk's blocks stay in L1 while every token passes

// One pass: weight rows x0 (and x1 when NR == 2) against NC tokens. y[c]: token c's blocks; yd[c]: their d as
// floats; ys: their s as floats, [nb][k_cols] (Q8_1 only); out[c * ldo + r] = row r . token c.
using Kernel = void (*)(int64_t nb, const void * x0, const void * x1, const uint8_t * const * y,
                        const float * const * yd, const float * ys, float * out, int64_t ldo);
using KernelTable = Kernel[k_cols][2];

struct Kernels {
    KernelTable q4_1, q8_0;
};

#ifdef KVF_QUANT_MATMUL_X86

// ggml's hsum_float_8 (ggml-cpu/arch/x86/quants.c; tinyBLAS's hsum is the same).
#define KVF_HSUM_8(v, out)                                                                                      \
    do {                                                                                                        \
        __m128 h_ = _mm256_extractf128_ps((v), 1);                                                              \
        h_ = _mm_add_ps(h_, _mm256_castps256_ps128(v));                                                         \
        h_ = _mm_add_ps(h_, _mm_movehl_ps(h_, h_));                                                             \
        h_ = _mm_add_ss(h_, _mm_movehdup_ps(h_));                                                               \
        (out) = _mm_cvtss_f32(h_);                                                                              \
    } while (0)

// ggml_vec_dot_q4_1_q8_1's AVX2 path per output, for NR rows and NC tokens at once: per block
// acc += (d0 * d1) * float(the 8 int32 sums of 4 u8 x s8 products) (an FMA) and summs += m * s (an FMA: the
// compiler contracts ggml's scalar line); the output is hsum_float_8(acc) + summs. DOT gives those int32 sums:
// vpdpbusd (AVX512-VNNI, as ggml's VNNI builds) or maddubs + madd (its AVX2 builds); they agree (4-bit x 8-bit
// pairs cannot saturate an int16).
#define KVF_Q4_1_KERNEL(NAME, TARGET, DOT)                                                                        \
    template <int NC, int NR>                                                                                   \
    __attribute__((target(TARGET))) void NAME(int64_t nb, const void * x0, const void * x1,                      \
                                              const uint8_t * const * yv, const float * const * yd,             \
                                              const float * ys, float * out, int64_t ldo) {                     \
        const BlockQ4_1 * xr[2] = {static_cast<const BlockQ4_1 *>(x0), static_cast<const BlockQ4_1 *>(x1)};    \
        const BlockQ8_1 * y[NC];                                                                                \
        for (int c = 0; c < NC; ++c) y[c] = reinterpret_cast<const BlockQ8_1 *>(yv[c]);                         \
        __m256 acc[NR][NC];                                                                                     \
        __m256 summs[NR];                                                                                       \
        for (int r = 0; r < NR; ++r) {                                                                          \
            summs[r] = _mm256_setzero_ps();                                                                     \
            for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();                                       \
        }                                                                                                       \
        const __m256i low = _mm256_set1_epi8(0xF);                                                              \
        for (int64_t ib = 0; ib < nb; ++ib) {                                                                   \
            const __m256 s = _mm256_loadu_ps(ys + ib * k_cols);                                                 \
            __m256i qx[NR];                                                                                     \
            __m256 d0[NR];                                                                                      \
            for (int r = 0; r < NR; ++r) {                                                                      \
                const BlockQ4_1 & b = xr[r][ib];                                                                \
                d0[r] = _mm256_set1_ps(_cvtsh_ss(b.d));                                                         \
                summs[r] = _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(b.m)), s, summs[r]);                        \
                const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i *>(b.qs));                    \
                qx[r] = _mm256_and_si256(low, _mm256_set_m128i(_mm_srli_epi16(t, 4), t));                       \
            }                                                                                                   \
            for (int c = 0; c < NC; ++c) {                                                                      \
                const __m256i qy = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(y[c][ib].qs));         \
                const __m256 d1 = _mm256_set1_ps(yd[c][ib]);                                                    \
                for (int r = 0; r < NR; ++r) {                                                                  \
                    const __m256 xy = _mm256_cvtepi32_ps(DOT(qx[r], qy));                                       \
                    acc[r][c] = _mm256_fmadd_ps(_mm256_mul_ps(d0[r], d1), xy, acc[r][c]);                       \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
        for (int r = 0; r < NR; ++r) {                                                                          \
            alignas(32) float sm[8];                                                                            \
            _mm256_store_ps(sm, summs[r]);                                                                      \
            for (int c = 0; c < NC; ++c) {                                                                      \
                float h;                                                                                        \
                KVF_HSUM_8(acc[r][c], h);                                                                       \
                out[c * ldo + r] = h + sm[c];                                                                   \
            }                                                                                                   \
        }                                                                                                       \
    }

// ggml_vec_dot_q8_0_q8_0's AVX2 path per output (and tinyBLAS_Q0_AVX's, which computes the same): per block
// acc += (d0 * d1) * float(the 8 int32 sums of 4 products |x| * sign(y, x)); the output is hsum_float_8(acc).
#define KVF_Q8_0_KERNEL(NAME, TARGET, DOT)                                                                        \
    template <int NC, int NR>                                                                                   \
    __attribute__((target(TARGET))) void NAME(int64_t nb, const void * x0, const void * x1,                      \
                                              const uint8_t * const * yv, const float * const * yd,             \
                                              const float *, float * out, int64_t ldo) {                        \
        const BlockQ8_0 * xr[2] = {static_cast<const BlockQ8_0 *>(x0), static_cast<const BlockQ8_0 *>(x1)};    \
        const BlockQ8_0 * y[NC];                                                                                \
        for (int c = 0; c < NC; ++c) y[c] = reinterpret_cast<const BlockQ8_0 *>(yv[c]);                         \
        __m256 acc[NR][NC];                                                                                     \
        for (int r = 0; r < NR; ++r)                                                                            \
            for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();                                       \
        for (int64_t ib = 0; ib < nb; ++ib) {                                                                   \
            __m256i qx[NR], ax[NR];                                                                             \
            __m256 d0[NR];                                                                                      \
            for (int r = 0; r < NR; ++r) {                                                                      \
                d0[r] = _mm256_set1_ps(_cvtsh_ss(xr[r][ib].d));                                                 \
                qx[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(xr[r][ib].qs));                   \
                ax[r] = _mm256_sign_epi8(qx[r], qx[r]);                                                         \
            }                                                                                                   \
            for (int c = 0; c < NC; ++c) {                                                                      \
                const __m256i qy = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(y[c][ib].qs));         \
                const __m256 d1 = _mm256_set1_ps(yd[c][ib]);                                                    \
                for (int r = 0; r < NR; ++r) {                                                                  \
                    const __m256 xy = _mm256_cvtepi32_ps(DOT(ax[r], _mm256_sign_epi8(qy, qx[r])));              \
                    acc[r][c] = _mm256_fmadd_ps(_mm256_mul_ps(d0[r], d1), xy, acc[r][c]);                       \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
        for (int r = 0; r < NR; ++r)                                                                            \
            for (int c = 0; c < NC; ++c) KVF_HSUM_8(acc[r][c], out[c * ldo + r]);                               \
    }

#define KVF_DOT_VNNI(a, b) _mm256_dpbusd_epi32(_mm256_setzero_si256(), (a), (b))
#define KVF_DOT_AVX2(a, b) _mm256_madd_epi16(_mm256_set1_epi16(1), _mm256_maddubs_epi16((a), (b)))
#define KVF_TARGET_VNNI "avx2,fma,f16c,avx512f,avx512vl,avx512vnni"
#define KVF_TARGET_AVX2 "avx2,fma,f16c"

KVF_Q4_1_KERNEL(q4_1_vnni, KVF_TARGET_VNNI, KVF_DOT_VNNI)
KVF_Q4_1_KERNEL(q4_1_avx2, KVF_TARGET_AVX2, KVF_DOT_AVX2)
KVF_Q8_0_KERNEL(q8_0_vnni, KVF_TARGET_VNNI, KVF_DOT_VNNI)
KVF_Q8_0_KERNEL(q8_0_avx2, KVF_TARGET_AVX2, KVF_DOT_AVX2)

#define KVF_ROW(K, NC) {K<NC, 1>, K<NC, 2>}
#define KVF_TABLE(K) {KVF_ROW(K, 1), KVF_ROW(K, 2), KVF_ROW(K, 3), KVF_ROW(K, 4), \
                      KVF_ROW(K, 5), KVF_ROW(K, 6), KVF_ROW(K, 7), KVF_ROW(K, 8)}
const Kernels k_vnni = {KVF_TABLE(q4_1_vnni), KVF_TABLE(q8_0_vnni)};
const Kernels k_avx2 = {KVF_TABLE(q4_1_avx2), KVF_TABLE(q8_0_avx2)};

// The kernels this CPU runs (nullptr: none).
const Kernels * cpu_kernels() {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("f16c")) return nullptr;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni")) {
        return &k_vnni;
    }
    return &k_avx2;
}

#else

const Kernels * cpu_kernels() { return nullptr; }

#endif

// The custom op, per thread: an even share of the weight rows against every token. Each thread reads the tokens'
// scales for itself (N x K/32 of them; a custom op has no barrier to share them after).
void quant_mul_mat_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const KernelTable & kernels = *static_cast<const KernelTable *>(userdata);
    const ggml_tensor * w = dst->src[0];
    const ggml_tensor * xq = dst->src[1];
    const bool q4_1 = w->type == GGML_TYPE_Q4_1;
    const int64_t nb = w->ne[0] / 32, M = w->ne[1], N = xq->ne[1];
    const int64_t per = ((M + nth - 1) / nth + 1) & ~int64_t(1);
    const int64_t r0 = std::min(M, ith * per), r1 = std::min(M, r0 + per);
    if (r0 >= r1) return;

    const int64_t groups = (N + k_cols - 1) / k_cols;
    const size_t y_block = q4_1 ? sizeof(BlockQ8_1) : sizeof(BlockQ8_0);
    auto token = [&](int64_t c) { return static_cast<const uint8_t *>(xq->data) + c * xq->nb[1]; };
    thread_local std::vector<float> d, s;
    d.resize((size_t) (N * nb));
    if (q4_1) s.assign((size_t) (groups * nb * k_cols), 0.0f);
    for (int64_t c = 0; c < N; ++c) {
        const uint8_t * y = token(c);
        float * sc = q4_1 ? s.data() + (c / k_cols) * nb * k_cols + c % k_cols : nullptr;
        for (int64_t ib = 0; ib < nb; ++ib, y += y_block) {
            uint16_t h[2];
            std::memcpy(h, y, q4_1 ? 4 : 2);
            d[(size_t) (c * nb + ib)] = ggml_fp16_to_fp32(h[0]);
            if (sc) sc[ib * k_cols] = ggml_fp16_to_fp32(h[1]);
        }
    }
    auto row = [&](int64_t r) { return static_cast<const uint8_t *>(w->data) + r * w->nb[1]; };
    float * out = static_cast<float *>(dst->data);
    const int64_t ldo = dst->nb[1] / (int64_t) sizeof(float);
    const uint8_t * y[k_cols];
    const float * yd[k_cols];
    for (int64_t rc = r0; rc < r1; rc += k_row_chunk) {
        const int64_t re = std::min(r1, rc + k_row_chunk);
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t c0 = g * k_cols, nc = std::min<int64_t>(k_cols, N - c0);
            for (int64_t c = 0; c < nc; ++c) {
                y[c] = token(c0 + c);
                yd[c] = d.data() + (c0 + c) * nb;
            }
            const float * ys = q4_1 ? s.data() + g * nb * k_cols : nullptr;
            for (int64_t r = rc; r < re; r += 2) {
                const int64_t nr = std::min<int64_t>(2, re - r);
                kernels[nc - 1][nr - 1](nb, row(r), row(r + nr - 1), y, yd, ys, out + c0 * ldo + r, ldo);
            }
        }
    }
}

const KernelTable * table_for(const Kernels & k, ggml_type type) {
    return type == GGML_TYPE_Q4_1 ? &k.q4_1 : type == GGML_TYPE_Q8_0 ? &k.q8_0 : nullptr;
}

ggml_tensor * custom_op(ggml_context * ctx, ggml_tensor * w, ggml_tensor * xq, const KernelTable * kernels) {
    ggml_tensor * args[2] = {w, xq};
    return ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[1], xq->ne[1], 1, 1, args, 2, quant_mul_mat_op, GGML_N_TASKS_MAX,
                          const_cast<KernelTable *>(kernels));
}

// Pseudo-random floats in [-scale/2, scale/2) (a fixed LCG: the check is the same every run).
std::vector<float> noise(size_t n, float scale, uint32_t seed) {
    std::vector<float> v(n);
    for (float & x : v) {
        seed = seed * 1664525u + 1013904223u;
        x = scale * ((float) (seed >> 8) / (float) (1u << 24) - 0.5f);
    }
    return v;
}

// ggml_mul_mat and the custom op on one small product through a CPU backend of this process (the variant ggml
// loaded): true when every output is bit for bit the same. 7 rows (the one-row pass too), 11 tokens (ggml's
// several-token path; a full group and a partial one), 8 blocks.
bool same_as_ggml(ggml_type type, const KernelTable * kernels) {
    constexpr int64_t K = 256, M = 7, N = 11;
    ggml_backend_t backend = cpu_backend_init();
    set_backend_threads(backend, 1);
    ggml_init_params params = {ggml_tensor_overhead() * 16 + ggml_graph_overhead(), nullptr, true};
    ggml_context * ctx = ggml_init(params);
    ggml_tensor * w = ggml_new_tensor_2d(ctx, type, K, M);
    ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, K, N);
    ggml_tensor * ref = ggml_mul_mat(ctx, w, x);
    ggml_tensor * xq = ggml_cpy(ctx, x, ggml_new_tensor_2d(ctx, quant_mul_mat_input_type(type), K, N));
    ggml_tensor * ours = custom_op(ctx, w, xq, kernels);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, ref);
    ggml_build_forward_expand(gf, ours);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
    bool same = false;
    if (buf) {
        const std::vector<float> wf = noise((size_t) (K * M), 0.2f, 1), xf = noise((size_t) (K * N), 6.0f, 2);
        std::vector<uint8_t> wq(ggml_row_size(type, K) * M);
        ggml_quantize_chunk(type, wf.data(), wq.data(), 0, M, K, nullptr);
        ggml_backend_tensor_set(w, wq.data(), 0, wq.size());
        ggml_backend_tensor_set(x, xf.data(), 0, xf.size() * sizeof(float));
        if (ggml_backend_graph_compute(backend, gf) == GGML_STATUS_SUCCESS) {
            std::vector<float> a((size_t) (M * N)), b((size_t) (M * N));
            ggml_backend_tensor_get(ref, a.data(), 0, a.size() * sizeof(float));
            ggml_backend_tensor_get(ours, b.data(), 0, b.size() * sizeof(float));
            same = std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
        }
        ggml_backend_buffer_free(buf);
    }
    ggml_free(ctx);
    ggml_backend_free(backend);
    return same;
}

// The kernels for weights of `type`, if this CPU has them and they compute ggml's sums here (checked once).
const KernelTable * checked_kernels(ggml_type type) {
    auto check = [](ggml_type t) -> const KernelTable * {
        const Kernels * k = cpu_kernels();
        if (!k) return nullptr;
        try {
            return same_as_ggml(t, table_for(*k, t)) ? table_for(*k, t) : nullptr;
        } catch (const std::exception &) {   // no CPU backend: nothing computes on one anyway
            return nullptr;
        }
    };
    if (type == GGML_TYPE_Q4_1) {
        static const KernelTable * q4_1 = check(GGML_TYPE_Q4_1);
        return q4_1;
    }
    if (type == GGML_TYPE_Q8_0) {
        static const KernelTable * q8_0 = check(GGML_TYPE_Q8_0);
        return q8_0;
    }
    return nullptr;
}

// ---- F16 products (f16_mul_mat) ------------------------------------------------------------------------------

constexpr int k_f16_tile_rows = 4;     // a tile: 4 rows x 2 columns, one accumulator per output (8 registers),
constexpr int k_f16_tile_cols = 2;     // 4 converted rows and 2 columns in registers: 6 loads per 8 FMAs
constexpr int64_t k_f16_rows = 8;      // rows summed up together (one transpose: f16_hsum8)
constexpr int64_t k_f16_chunk = 8;     // 32-value steps per pass when a row is longer: every tile's chunk stays in L1

// ggml_vec_dot_f16 (AVX, FMA, F16C) sums x . y in 4 chains: chain j (0..3) takes values 32 t + 8 j .. + 8 for
// t = 0, 1, ... in order, one 8-lane FMA each; then chain 0 + chain 2, 1 + 3, their sum, and a horizontal sum.
// The chains are independent, so a tile runs one chain at a time for all its outputs.
//
// One pass: rows x[r] (F16, NR of them) against columns y[c] (floats: F16 values, exact; n_cols of them), steps
// [t0, t1), in tiles of NR rows x 2 columns. acc: per output (r, c) at acc + r * row_stride + c * step its 4 chains
// (F16Kernels::step floats), read first when load, written back.
using F16Pass = void (*)(int64_t t0, int64_t t1, const ggml_fp16_t * const * x, const float * const * y, int64_t n_cols,
                         float * acc, int64_t row_stride, bool load);
// out[r] = the sum of output r's 4 chains at s + r * stride as ggml_vec_dot_f16 ends it, for r < 8.
using F16Hsum = void (*)(const float * s, int64_t stride, float * out);
struct F16Kernels {
    F16Pass pass[k_f16_tile_rows];   // [rows - 1]
    F16Hsum hsum8;
    int64_t step;                    // values per step (4 chains of step / 4 lanes): what acc holds per output
};

#ifdef KVF_QUANT_MATMUL_X86

template <int NR, int NC>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void f16_tile_avx2(
    int64_t t0, int64_t t1, const ggml_fp16_t * const * x, const float * const * y, float * acc, int64_t row_stride,
    bool load) {
    for (int j = 0; j < 4; ++j) {
        __m256 a[NR][NC];
        for (int r = 0; r < NR; ++r)
            for (int c = 0; c < NC; ++c) a[r][c] = load ? _mm256_load_ps(acc + r * row_stride + c * 32 + j * 8) : _mm256_setzero_ps();
        for (int64_t t = t0; t < t1; ++t) {
            const int64_t i = 32 * t + 8 * j;
            __m256 xv[NR], yv[NC];
            for (int r = 0; r < NR; ++r) xv[r] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(x[r] + i)));
            for (int c = 0; c < NC; ++c) yv[c] = _mm256_loadu_ps(y[c] + i);
            for (int r = 0; r < NR; ++r)
                for (int c = 0; c < NC; ++c) a[r][c] = _mm256_fmadd_ps(xv[r], yv[c], a[r][c]);
        }
        for (int r = 0; r < NR; ++r)
            for (int c = 0; c < NC; ++c) _mm256_store_ps(acc + r * row_stride + c * 32 + j * 8, a[r][c]);
    }
}

template <int NR>
__attribute__((target("avx2,fma,f16c"))) void f16_pass_avx2(int64_t t0, int64_t t1, const ggml_fp16_t * const * x,
                                                              const float * const * y, int64_t n_cols, float * acc,
                                                              int64_t row_stride, bool load) {
    int64_t c = 0;
    for (; c + k_f16_tile_cols <= n_cols; c += k_f16_tile_cols) {
        f16_tile_avx2<NR, k_f16_tile_cols>(t0, t1, x, y + c, acc + c * 32, row_stride, load);
    }
    if (c < n_cols) f16_tile_avx2<NR, 1>(t0, t1, x, y + c, acc + c * 32, row_stride, load);
}

// The end of ggml_vec_dot_f16's AVX reduction for 8 outputs at once: chains (0 + 2) + (1 + 3), the 128-bit halves
// added, two hadds, i.e. ((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7)) over the lanes s: the same additions
// on the lanes of a transpose. s: output r's 4 chains at s + r * stride.
__attribute__((target("avx2"))) void f16_hsum8_avx2(const float * s, int64_t stride, float * out) {
    __m256 r[8];
    for (int i = 0; i < 8; ++i) {
        const float * c = s + i * stride;
        r[i] = _mm256_add_ps(_mm256_add_ps(_mm256_load_ps(c), _mm256_load_ps(c + 16)),
                             _mm256_add_ps(_mm256_load_ps(c + 8), _mm256_load_ps(c + 24)));
    }
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);       // lanes 0, 1 of rows i, i + 1 | lanes 4, 5
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);   // lanes 2, 3 | 6, 7
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);           // lane 0 of rows i..i+3 | lane 4
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);       // lane 1 | lane 5
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);   // lane 2 | lane 6
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);   // lane 3 | lane 7
    }
    __m256 lane[8];   // lane[l][i] = r[i][l]
    for (int l = 0; l < 4; ++l) {
        lane[l] = _mm256_permute2f128_ps(u[l], u[l + 4], 0x20);
        lane[l + 4] = _mm256_permute2f128_ps(u[l], u[l + 4], 0x31);
    }
    const __m256 a = _mm256_add_ps(_mm256_add_ps(lane[0], lane[4]), _mm256_add_ps(lane[1], lane[5]));
    const __m256 b = _mm256_add_ps(_mm256_add_ps(lane[2], lane[6]), _mm256_add_ps(lane[3], lane[7]));
    _mm256_storeu_ps(out, _mm256_add_ps(a, b));
}

// b's F32 values as ggml's mul_mat rounds them to F16 (ggml_cpu_fp32_to_fp16: round to nearest even), widened back.
__attribute__((target("avx2,f16c"))) void round_to_f16(const float * from, float * to, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(to + i, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(from + i), 0)));
    for (; i < n; ++i) to[i] = _cvtsh_ss(_cvtss_sh(from[i], 0));
}

const F16Kernels k_f16_avx2 = {{f16_pass_avx2<1>, f16_pass_avx2<2>, f16_pass_avx2<3>, f16_pass_avx2<4>}, f16_hsum8_avx2, 32};

// ggml's AVX-512 variants without AVX512-FP16 sum ggml_vec_dot_f16 in 4 chains of 16 lanes over 64 values a step
// (GGML_F16_STEP 64), then chains (0 + 2) + (1 + 3) and _mm512_reduce_add_ps: the AVX2 kernels' order, twice as wide.
template <int NR, int NC>
__attribute__((target("avx512f"), always_inline)) inline void f16_tile_avx512(
    int64_t t0, int64_t t1, const ggml_fp16_t * const * x, const float * const * y, float * acc, int64_t row_stride,
    bool load) {
    for (int j = 0; j < 4; ++j) {
        __m512 a[NR][NC];
        for (int r = 0; r < NR; ++r)
            for (int c = 0; c < NC; ++c) a[r][c] = load ? _mm512_loadu_ps(acc + r * row_stride + c * 64 + j * 16) : _mm512_setzero_ps();
        for (int64_t t = t0; t < t1; ++t) {
            const int64_t i = 64 * t + 16 * j;
            __m512 xv[NR], yv[NC];
            for (int r = 0; r < NR; ++r) xv[r] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(x[r] + i)));
            for (int c = 0; c < NC; ++c) yv[c] = _mm512_loadu_ps(y[c] + i);
            for (int r = 0; r < NR; ++r)
                for (int c = 0; c < NC; ++c) a[r][c] = _mm512_fmadd_ps(xv[r], yv[c], a[r][c]);
        }
        for (int r = 0; r < NR; ++r)
            for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + r * row_stride + c * 64 + j * 16, a[r][c]);
    }
}

template <int NR>
__attribute__((target("avx512f"))) void f16_pass_avx512(int64_t t0, int64_t t1, const ggml_fp16_t * const * x,
                                                          const float * const * y, int64_t n_cols, float * acc,
                                                          int64_t row_stride, bool load) {
    int64_t c = 0;
    for (; c + k_f16_tile_cols <= n_cols; c += k_f16_tile_cols) {
        f16_tile_avx512<NR, k_f16_tile_cols>(t0, t1, x, y + c, acc + c * 64, row_stride, load);
    }
    if (c < n_cols) f16_tile_avx512<NR, 1>(t0, t1, x, y + c, acc + c * 64, row_stride, load);
}

__attribute__((target("avx512f"))) void f16_hsum8_avx512(const float * s, int64_t stride, float * out) {
    for (int i = 0; i < 8; ++i) {
        const float * c = s + i * stride;
        const __m512 v = _mm512_add_ps(_mm512_add_ps(_mm512_loadu_ps(c), _mm512_loadu_ps(c + 32)),
                                       _mm512_add_ps(_mm512_loadu_ps(c + 16), _mm512_loadu_ps(c + 48)));
        out[i] = _mm512_reduce_add_ps(v);
    }
}

const F16Kernels k_f16_avx512 = {{f16_pass_avx512<1>, f16_pass_avx512<2>, f16_pass_avx512<3>, f16_pass_avx512<4>},
                                 f16_hsum8_avx512, 64};

// The kernels this CPU runs, widest first: which one sums as the loaded ggml variant does is for the check to say.
std::vector<const F16Kernels *> f16_cpu_kernels() {
    __builtin_cpu_init();
    std::vector<const F16Kernels *> out;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("f16c")) out.push_back(&k_f16_avx512);
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
        out.push_back(&k_f16_avx2);
    }
    return out;
}

#else

std::vector<const F16Kernels *> f16_cpu_kernels() { return {}; }
void round_to_f16(const float *, float *, int64_t) { throw std::logic_error("f16_mul_mat: no kernels on this CPU"); }

#endif

// Rows [r0, r1) of a's matrix h against n_cols columns ys (rounded to F16, widened), writing outs[c][row]:
// k_f16_rows rows at a time in tiles, in passes of k_f16_chunk steps when a row is longer; then their chains
// (acc: step floats per row and column) summed up 8 rows at a time, and the values past the last multiple of step
// added in double one product at a time, as ggml_vec_dot_f16 ends.
void f16_rows(const F16Kernels & k, const ggml_tensor * a, int64_t h, int64_t r0, int64_t r1, const float * const * ys,
              float * const * outs, int64_t n_cols, float * acc) {
    const int64_t K = a->ne[0], np = K & ~(k.step - 1), n_steps = np / k.step;
    const auto row = [&](int64_t r) {
        return reinterpret_cast<const ggml_fp16_t *>(static_cast<const char *>(a->data) + r * a->nb[1] + h * a->nb[2]);
    };
    const int64_t row_floats = n_cols * k.step;
    for (int64_t rb = r0; rb < r1; rb += k_f16_rows) {
        const int64_t re = std::min(r1, rb + k_f16_rows);
        if (n_steps == 0) std::fill(acc, acc + k_f16_rows * row_floats, 0.0f);
        for (int64_t t0 = 0; t0 < n_steps; t0 += k_f16_chunk) {
            const int64_t t1 = std::min(n_steps, t0 + k_f16_chunk);
            for (int64_t r = rb; r < re; r += k_f16_tile_rows) {
                const int nr = (int) std::min<int64_t>(k_f16_tile_rows, re - r);
                const ggml_fp16_t * x[k_f16_tile_rows];
                for (int i = 0; i < nr; ++i) x[i] = row(r + i);
                k.pass[nr - 1](t0, t1, x, ys, n_cols, acc + (r - rb) * row_floats, row_floats, t0 > 0);
            }
        }
        for (int64_t c = 0; c < n_cols; ++c) {
            alignas(32) float sums[k_f16_rows];
            k.hsum8(acc + c * k.step, row_floats, sums);   // rows past re: stale floats, never written out
            if (np == K) {
                std::memcpy(outs[c] + rb, sums, (size_t) (re - rb) * sizeof(float));
                continue;
            }
            for (int64_t r = rb; r < re; ++r) {
                double sum = sums[r - rb];
                const ggml_fp16_t * x = row(r);
                for (int64_t i = np; i < K; ++i) sum += (double) (ggml_fp16_to_fp32(x[i]) * ys[c][i]);
                outs[c][r] = (float) sum;
            }
        }
    }
}

// The custom op, per thread: an even share of the rows of every matrix of a (head-major), each against every
// column of the matrices of b that use it. Each thread rounds the columns it needs for itself (a custom op has no
// barrier to share them after): at most N x B x K values, a small part of the M x N x B x K products.
void f16_mul_mat_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const F16Kernels & k = *static_cast<const F16Kernels *>(userdata);
    const ggml_tensor * a = dst->src[0];
    const ggml_tensor * b = dst->src[1];
    const int64_t K = a->ne[0], M = a->ne[1], N = b->ne[1], B = b->ne[2], r = B / a->ne[2], n_cols = r * N;
    // Work in blocks of k_f16_rows rows of one matrix, an even share of them per thread.
    const int64_t blocks_per_matrix = (M + k_f16_rows - 1) / k_f16_rows, blocks = blocks_per_matrix * a->ne[2];
    const int64_t per = (blocks + nth - 1) / nth, b0 = std::min(blocks, ith * per), b1 = std::min(blocks, b0 + per);
    if (b0 >= b1) return;
    thread_local std::vector<float> y_buf, acc_buf;
    y_buf.resize((size_t) (K * N * B));
    acc_buf.resize((size_t) (k_f16_rows * n_cols * k.step + 8));
    float * y = y_buf.data();
    float * acc = reinterpret_cast<float *>((reinterpret_cast<uintptr_t>(acc_buf.data()) + 31) & ~uintptr_t(31));
    // only the columns of the matrices this thread's rows meet
    for (int64_t i2 = b0 / blocks_per_matrix * r; i2 < ((b1 - 1) / blocks_per_matrix + 1) * r; ++i2) {
        for (int64_t i1 = 0; i1 < N; ++i1) {
            const auto * col = reinterpret_cast<const float *>(static_cast<const char *>(b->data) + i1 * b->nb[1] + i2 * b->nb[2]);
            round_to_f16(col, y + (i2 * N + i1) * K, K);
        }
    }
    std::vector<const float *> ys((size_t) n_cols);
    std::vector<float *> outs((size_t) n_cols);
    for (int64_t blk = b0; blk < b1;) {
        const int64_t h = blk / blocks_per_matrix, first = blk % blocks_per_matrix;
        const int64_t last = std::min(blocks_per_matrix, first + (b1 - blk));   // this matrix's blocks [first, last)
        for (int64_t c = 0; c < n_cols; ++c) {   // column c: matrix h * r + c / N, column c % N
            const int64_t i2 = h * r + c / N, i1 = c % N;
            ys[(size_t) c] = y + (i2 * N + i1) * K;
            outs[(size_t) c] = reinterpret_cast<float *>(static_cast<char *>(dst->data) + i1 * dst->nb[1] + i2 * dst->nb[2]);
        }
        f16_rows(k, a, h, first * k_f16_rows, std::min(M, last * k_f16_rows), ys.data(), outs.data(), n_cols, acc);
        blk += last - first;
    }
}

ggml_tensor * f16_custom_op(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b, const F16Kernels * kernels) {
    ggml_tensor * args[2] = {a, b};
    return ggml_custom_4d(ctx, GGML_TYPE_F32, a->ne[1], b->ne[1], b->ne[2], 1, args, 2, f16_mul_mat_op, GGML_N_TASKS_MAX,
                          const_cast<F16Kernels *>(kernels));
}

// ggml_mul_mat of each column alone (its one-column path) and the custom op over every column at once, on small
// products through a CPU backend of this process: true when every output is bit for bit the same. K = 80 (two
// 32-value steps and a leftover of 16) and K = 600 (passes of k_f16_chunk steps and a leftover of 24), 11 rows (a
// block of k_f16_rows, tiles of 4 and 3), 5 columns (tiles of 2 and 1), 2 matrices broadcast to 4, b permuted
// as attention's queries are.
bool f16_same_as_ggml(const F16Kernels * kernels) {
    constexpr int64_t M = 11, N = 5, A = 2, B = 4;
    ggml_backend_t backend = cpu_backend_init();
    set_backend_threads(backend, 1);
    ggml_init_params params = {ggml_tensor_overhead() * 64 + ggml_graph_overhead(), nullptr, true};
    ggml_context * ctx = ggml_init(params);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    struct Case {
        int64_t K;
        ggml_tensor * a, * x, * ours;
        std::vector<ggml_tensor *> ref;
    } cases[2] = {{80, nullptr, nullptr, nullptr, {}}, {600, nullptr, nullptr, nullptr, {}}};
    for (Case & t : cases) {
        t.a = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, t.K, M, A);
        t.x = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, t.K, B, N);   // [K, B, N]: columns permuted in
        ggml_tensor * xp = ggml_permute(ctx, t.x, 0, 2, 1, 3);    // [K, N, B], not contiguous
        t.ours = f16_custom_op(ctx, t.a, xp, kernels);
        ggml_build_forward_expand(gf, t.ours);
        for (int64_t i1 = 0; i1 < N; ++i1) {   // column i1 of every matrix: [K, 1, B]
            t.ref.push_back(ggml_mul_mat(ctx, t.a, ggml_view_3d(ctx, xp, t.K, 1, B, xp->nb[1], xp->nb[2], i1 * xp->nb[1])));
            ggml_build_forward_expand(gf, t.ref.back());
        }
    }
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
    bool same = buf != nullptr;
    if (buf) {
        for (Case & t : cases) {
            const std::vector<float> af = noise((size_t) (t.K * M * A), 2.0f, 3), xf = noise((size_t) (t.K * N * B), 2.0f, 4);
            std::vector<ggml_fp16_t> ah(af.size());
            for (size_t i = 0; i < af.size(); ++i) ah[i] = ggml_fp32_to_fp16(af[i]);
            ggml_backend_tensor_set(t.a, ah.data(), 0, ah.size() * sizeof(ggml_fp16_t));
            ggml_backend_tensor_set(t.x, xf.data(), 0, xf.size() * sizeof(float));
        }
        same = ggml_backend_graph_compute(backend, gf) == GGML_STATUS_SUCCESS;
        for (Case & t : cases) {
            std::vector<float> got((size_t) (M * N * B)), want(got.size()), col((size_t) (M * B));
            ggml_backend_tensor_get(t.ours, got.data(), 0, got.size() * sizeof(float));
            for (int64_t i1 = 0; i1 < N; ++i1) {   // ref[i1]: [M, 1, B] -> want[i2][i1][:]
                ggml_backend_tensor_get(t.ref[i1], col.data(), 0, col.size() * sizeof(float));
                for (int64_t i2 = 0; i2 < B; ++i2) std::memcpy(&want[(size_t) ((i2 * N + i1) * M)], &col[(size_t) (i2 * M)], M * sizeof(float));
            }
            same = same && std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) == 0;
        }
        ggml_backend_buffer_free(buf);
    }
    ggml_free(ctx);
    ggml_backend_free(backend);
    return same;
}

const F16Kernels * checked_f16_kernels() {
    static const F16Kernels * kernels = []() -> const F16Kernels * {
        try {
            for (const F16Kernels * k : f16_cpu_kernels())
                if (f16_same_as_ggml(k)) return k;
        } catch (const std::exception &) {   // no CPU backend: nothing computes on one anyway
        }
        return nullptr;
    }();
    return kernels;
}

}  // namespace

bool f16_mul_mat_usable() { return g_mode.load() != 0 && checked_f16_kernels() != nullptr; }

ggml_tensor * f16_mul_mat(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b) {
    const F16Kernels * kernels = checked_f16_kernels();
    if (!kernels) throw std::logic_error("f16_mul_mat: not usable in this process (check f16_mul_mat_usable)");
    if (a->type != GGML_TYPE_F16 || b->type != GGML_TYPE_F32 || a->ne[0] != b->ne[0] || a->nb[0] != sizeof(ggml_fp16_t) ||
        b->nb[0] != sizeof(float) || a->ne[3] != 1 || b->ne[3] != 1 || b->ne[2] % a->ne[2] != 0) {
        throw std::invalid_argument("f16_mul_mat: needs F16 a [K, M, A] and F32 b [K, N, B] with rows along K, B a multiple of A");
    }
    return f16_custom_op(ctx, a, b, kernels);
}

bool quant_mul_mat_usable(ggml_type type) { return g_mode.load() != 0 && checked_kernels(type) != nullptr; }

void set_quant_mul_mat_mode(int mode) { g_mode.store(mode); }

ggml_type quant_mul_mat_input_type(ggml_type type) {
    if (type == GGML_TYPE_Q4_1) return GGML_TYPE_Q8_1;
    if (type == GGML_TYPE_Q8_0) return GGML_TYPE_Q8_0;
    throw std::invalid_argument(std::string("quant_mul_mat: no kernel for ") + ggml_type_name(type) + " weights");
}

ggml_tensor * quant_mul_mat(ggml_context * ctx, ggml_tensor * w, ggml_tensor * xq) {
    const KernelTable * kernels = checked_kernels(w->type);
    if (!kernels) {
        throw std::logic_error(std::string("quant_mul_mat: not usable for ") + ggml_type_name(w->type) +
                               " weights in this process (check quant_mul_mat_usable)");
    }
    if (xq->type != quant_mul_mat_input_type(w->type) || w->ne[0] != xq->ne[0] || w->ne[0] % 32 != 0 ||
        w->ne[2] != 1 || w->ne[3] != 1 || xq->ne[2] != 1 || xq->ne[3] != 1 || !ggml_is_contiguous(xq)) {
        throw std::invalid_argument("quant_mul_mat: needs weights [K, M] and their activations [K, N], K a multiple of 32");
    }
    return custom_op(ctx, w, xq, kernels);
}

}  // namespace kvf
