#include "reference/llama_reference.h"

#include "llama.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

namespace kvf {

LlamaReference::LlamaReference(const std::string & path, int n_ctx, int n_threads, bool flash_attn, int n_gpu_layers,
                               bool repack) {
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = n_gpu_layers;
    mp.use_extra_bufts = repack;
    model_ = llama_model_load_from_file(path.c_str(), mp);
    if (!model_) throw std::runtime_error("libllama could not load '" + path + "'");
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_ctx;
    cp.n_batch = n_batch_;
    cp.n_ubatch = n_batch_;
    cp.n_threads = cp.n_threads_batch = n_threads;
    cp.flash_attn_type = flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    ctx_ = llama_init_from_model(model_, cp);
    if (!ctx_) {
        llama_model_free(model_);
        throw std::runtime_error("libllama could not create a context for '" + path + "'");
    }
}

LlamaReference::~LlamaReference() {
    if (ctx_) llama_free(ctx_);
    if (model_) llama_model_free(model_);
}

int32_t LlamaReference::n_vocab() const { return llama_vocab_n_tokens(llama_model_get_vocab(model_)); }

void LlamaReference::clear() {
    llama_memory_clear(llama_get_memory(ctx_), true);
    n_past_ = 0;
}

void LlamaReference::remove(int64_t p0, int64_t p1) {
    if (p0 < 0 || p1 < p0 || p1 > n_past_) {
        throw std::invalid_argument("remove: need 0 <= p0 <= p1 <= n_past (" + std::to_string(n_past_) + ")");
    }
    if (!llama_memory_seq_rm(llama_get_memory(ctx_), 0, (llama_pos) p0, (llama_pos) p1)) {
        throw std::runtime_error("llama_memory_seq_rm refused the range");
    }
    if (p1 == n_past_) n_past_ = p0;
}

std::vector<float> LlamaReference::decode(const std::vector<int32_t> & tokens, bool all_logits) {
    const int64_t n = (int64_t) tokens.size();
    const int32_t nv = n_vocab();
    // libllama asserts (aborts the process) on a batch past its context or a token outside the vocabulary
    const int64_t n_ctx = (int64_t) llama_n_ctx(ctx_);
    if (n_past_ + n > n_ctx) {
        throw std::invalid_argument("decode: " + std::to_string(n) + " tokens after " + std::to_string(n_past_) +
                                    " exceed the reference's n_ctx=" + std::to_string(n_ctx));
    }
    for (int32_t t : tokens) {
        if (t < 0 || t >= nv) throw std::invalid_argument("decode: token id " + std::to_string(t) + " outside the vocabulary");
    }
    std::vector<float> out((size_t) (all_logits ? n : 1) * nv);
    // libllama caps the batch at the context it was asked for: step by what it kept
    const int64_t n_batch = std::min<int64_t>(n_batch_, (int64_t) llama_n_batch(ctx_));
    llama_batch batch = llama_batch_init((int32_t) n_batch, 0, 1);
    for (int64_t done = 0; done < n;) {
        const int64_t step = std::min<int64_t>(n_batch, n - done);
        batch.n_tokens = (int32_t) step;
        for (int64_t i = 0; i < step; ++i) {
            batch.token[i] = tokens[done + i];
            batch.pos[i] = (llama_pos) (n_past_ + i);
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = all_logits || (done + i == n - 1);
        }
        if (llama_decode(ctx_, batch) != 0) {
            llama_batch_free(batch);
            throw std::runtime_error("llama_decode failed");
        }
        for (int64_t i = 0; i < step; ++i) {
            if (!batch.logits[i]) continue;
            const float * l = llama_get_logits_ith(ctx_, (int32_t) i);
            std::memcpy(out.data() + (all_logits ? (size_t) (done + i) * nv : 0), l, sizeof(float) * nv);
        }
        n_past_ += step;
        done += step;
    }
    llama_batch_free(batch);
    return out;
}

}  // namespace kvf
