// LlamaReference: libllama's own llama_decode on a GGUF, used by the tests as the reference nobody
// here wrote. Full KV cache, one sequence, logits for every token.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

struct llama_model;
struct llama_context;

namespace kvf {

class LlamaReference {
public:
    // n_gpu_layers: layers libllama offloads to a GPU (0: CPU only; large: everything), as llama.cpp's -ngl.
    // repack: libllama's CPU weight repacking (llama_model_params.use_extra_bufts, on by default) runs other
    // matmul kernels than ggml's plain ones, which we use: off, the two compute the same sums.
    LlamaReference(const std::string & path, int n_ctx, int n_threads, bool flash_attn, int n_gpu_layers = 0,
                   bool repack = true);
    ~LlamaReference();
    LlamaReference(const LlamaReference &) = delete;
    LlamaReference & operator=(const LlamaReference &) = delete;

    // Appends tokens to the sequence; returns logits [n, n_vocab] (all) or [n_vocab] (last).
    std::vector<float> decode(const std::vector<int32_t> & tokens, bool all_logits);
    void clear();
    // Forgets positions [p0, p1) (llama_memory_seq_rm); a range that reaches the end moves n_past back to p0.
    // Used to ask libllama what the last tokens see when only some chunks of a full-context cache remain.
    void remove(int64_t p0, int64_t p1);
    int32_t n_vocab() const;
    int64_t n_past() const { return n_past_; }

private:
    llama_model * model_ = nullptr;
    llama_context * ctx_ = nullptr;
    int64_t n_past_ = 0;
    int n_batch_ = 512;
};

}  // namespace kvf
