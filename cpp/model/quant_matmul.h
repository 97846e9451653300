// Quantized weights times a few tokens on the CPU: the sums ggml computes, several tokens per pass.
//
// A step of n tokens through ggml's CPU backend: Q4_1 weights have no matrix-matrix kernel on x86 (llamafile's
// tinyBLAS, the tiled and the repacked paths take other types), so each output is one ggml_vec_dot_q4_1_q8_1,
// a serial chain of one FMA per 32 weights, and the n tokens cost n single-token steps; Q8_0 weights go through
// tinyBLAS, which reads the whole matrix once per 4 tokens (a 5-token step reads SmolLM2's 28 MiB output matrix
// twice). quant_mul_mat computes each output with exactly the operations of ggml's x86 dot product for the type
// (the same int32 sums of 4 products, the same FMAs in the same order, the same horizontal sum; tinyBLAS's Q8_0
// outputs are those too), for two weight rows and up to eight tokens at once: the chains run side by side,
// each weight block is loaded (and unpacked) once per pass, and up to eight tokens take one pass over the
// weights. The outputs are bit for bit ggml's. The activations are quantized by ggml itself (a cpy to the type
// mul_mat quantizes them to), once per input for every matmul that reads it (q, k and v; gate and up).
//
// On SmolLM2-135M (Q4_1 layers, Q8_0 output) on 2 cores a verify step of 8 tokens went from 26.7 to ~15 ms; a
// single token (plain decoding) stays on ggml's own path.
//
// Used only where the result is checked to be ggml's: x86-64 with AVX2, FMA and F16C, and a one-time comparison
// per type with ggml_mul_mat on a CPU backend of this process (the variant ggml loaded decides how its dot
// products round) that came out identical; otherwise graphs use ggml_mul_mat.
#pragma once

#include "ggml.h"

namespace kvf {

// Whether weights of this type (Q4_1, Q8_0) times several tokens may go through quant_mul_mat in this process
// (checked once per type, thread-safe), and it is not switched off.
bool quant_mul_mat_usable(ggml_type type);

// Tests and benchmarks: -1 = automatic (quant_mul_mat_usable's checks), 0 = never (ggml_mul_mat everywhere).
// Graphs built afterwards follow it.
void set_quant_mul_mat_mode(int mode);

// The type ggml quantizes the activations to for weights of `type` (its vec_dot type: Q8_1 for Q4_1, Q8_0 for
// Q8_0); quant_mul_mat takes them in that type.
ggml_type quant_mul_mat_input_type(ggml_type type);

// w: Q4_1 or Q8_0 [K, M] in host memory (plain blocks, not repacked); xq: [K, N] of quant_mul_mat_input_type
// (a ggml_cpy of the F32 activations). Returns F32 [M, N]: what ggml_mul_mat(w, x) returns.
ggml_tensor * quant_mul_mat(ggml_context * ctx, ggml_tensor * w, ggml_tensor * xq);

// F16 matrices times a few columns on the CPU: attention's products in a short step (a speculative verify step).
// ggml's CPU backend computes a product of one column with ggml_vec_dot_f16 for each output (the column rounded to
// F16 first), and one of several columns with llamafile's tinyBLAS, whose sums run in another order: a verify
// step's rows then differed from plain decoding's (by up to ~0.9 in a SmolLM2 logit), and greedy near-ties
// flipped. f16_mul_mat computes each output with exactly ggml_vec_dot_f16's operations (its AVX2 path: four 8-lane
// FMA chains over 32 values at a time, the same reduction, the leftover in double; its AVX-512 path: 16 lanes over
// 64), on the columns rounded as ggml rounds them, three columns per pass over a row (long rows in chunks that stay
// in L1). Checked bit for bit against ggml_mul_mat of one column once per process (the ggml variant loaded decides
// how its dot product sums); f16_mul_mat_usable() is false where neither matches (a ggml built with AVX512-FP16
// sums in F16: native builds turn it off, CMakeLists.txt), where the CPU lacks AVX2, FMA or F16C, or in mode 0.
bool f16_mul_mat_usable();

// a: F16 [K, M, A] (rows contiguous along K, any other strides); b: F32 [K, N, B] (likewise), B a multiple of A
// (b's matrix i uses a's matrix i / (B / A), as ggml_mul_mat broadcasts). Returns F32 [M, N, B]: what
// ggml_mul_mat(a, b) computes for one column of b at a time.
ggml_tensor * f16_mul_mat(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b);

}  // namespace kvf
