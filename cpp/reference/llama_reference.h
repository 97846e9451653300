// LlamaReference: libllama's own llama_decode on a GGUF, used by the tests as the reference nobody
// here wrote. Full KV cache, one sequence, logits for every token. With mtp, also libllama's multi-token-prediction
// context (LLAMA_CONTEXT_TYPE_MTP on the same model), fed as llama.cpp's MTP drafter feeds it: every decoded batch
// runs through it too, each token paired with the trunk's h_nextn of the token before (zeros before the first).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

struct llama_model;
struct llama_context;
struct llama_batch;

namespace kvf {

class LlamaReference {
public:
    // n_gpu_layers: layers libllama offloads to a GPU (0: CPU only; large: everything), as llama.cpp's -ngl.
    // repack: libllama's CPU weight repacking (llama_model_params.use_extra_bufts, on by default) runs other
    // matmul kernels than ggml's plain ones, which we use: off, the two compute the same sums.
    LlamaReference(const std::string & path, int n_ctx, int n_threads, bool flash_attn, int n_gpu_layers = 0,
                   bool repack = true, bool mtp = false);
    ~LlamaReference();
    LlamaReference(const LlamaReference &) = delete;
    LlamaReference & operator=(const LlamaReference &) = delete;

    // Appends tokens to the sequence; returns logits [n, n_vocab] (all) or [n_vocab] (last).
    std::vector<float> decode(const std::vector<int32_t> & tokens, bool all_logits);
    void clear();
    // The MTP context's logits [n, n_vocab] of a draft chain after the decoded tokens: tokens[0] at n_past paired
    // with the trunk's last h_nextn, tokens[i] at n_past + i with the MTP's own h_nextn of step i - 1 (llama.cpp's
    // draft loop). The drafts' positions are removed from the MTP context afterwards.
    std::vector<float> mtp_draft(const std::vector<int32_t> & tokens);
    // Forgets positions [p0, p1) (llama_memory_seq_rm); a range that reaches the end moves n_past back to p0.
    // Used to ask libllama what the last tokens see when only some chunks of a full-context cache remain.
    void remove(int64_t p0, int64_t p1);
    int32_t n_vocab() const;
    int64_t n_past() const { return n_past_; }

private:
    llama_model * model_ = nullptr;
    llama_context * ctx_ = nullptr;
    llama_context * mtp_ctx_ = nullptr;   // mtp only
    std::vector<float> pending_h_;        // mtp: the trunk's h_nextn at n_past - 1 (zeros at 0)
    int64_t n_past_ = 0;
    void follow(const llama_batch & batch);   // mtp: the decoded batch through the MTP context
    int n_batch_ = 512;
};

}  // namespace kvf
