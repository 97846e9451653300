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

}  // namespace

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
