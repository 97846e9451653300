#include "reference/llama_reference.h"

#include "llama.h"
// libllama's staging API (h_nextn outputs), reached as llama.cpp's own common/speculative.cpp includes it
#include "../src/llama-ext.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

namespace kvf {

LlamaReference::LlamaReference(const std::string & path, int n_ctx, int n_threads, bool flash_attn, int n_gpu_layers,
                               bool repack, bool mtp) {
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = n_gpu_layers;
    mp.use_extra_bufts = repack;
    mp.load_mtp = mtp;
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
    if (!mtp) return;
    if (llama_model_n_layer_nextn(model_) == 0) {
        llama_free(ctx_);
        llama_model_free(model_);
        throw std::invalid_argument("'" + path + "' has no multi-token-prediction (nextn) layers");
    }
    cp.ctx_type = LLAMA_CONTEXT_TYPE_MTP;
    mtp_ctx_ = llama_init_from_model(model_, cp);
    if (!mtp_ctx_) {
        llama_free(ctx_);
        llama_model_free(model_);
        throw std::runtime_error("libllama could not create an MTP context for '" + path + "'");
    }
    llama_set_embeddings_nextn(ctx_, true, /*masked =*/ false);   // every token's h_nextn, for the hook
    llama_set_embeddings_nextn(mtp_ctx_, true, /*masked =*/ true);
    pending_h_.assign((size_t) llama_model_n_embd(model_), 0.0f);
}

LlamaReference::~LlamaReference() {
    if (mtp_ctx_) llama_free(mtp_ctx_);
    if (ctx_) llama_free(ctx_);
    if (model_) llama_model_free(model_);
}

int32_t LlamaReference::n_vocab() const { return llama_vocab_n_tokens(llama_model_get_vocab(model_)); }

void LlamaReference::clear() {
    llama_memory_clear(llama_get_memory(ctx_), true);
    if (mtp_ctx_) {
        llama_memory_clear(llama_get_memory(mtp_ctx_), true);
        std::fill(pending_h_.begin(), pending_h_.end(), 0.0f);
    }
    n_past_ = 0;
}

void LlamaReference::remove(int64_t p0, int64_t p1) {
    if (mtp_ctx_) throw std::logic_error("remove: an MTP reference cannot forget (the trunk's h_nextn before p0 is gone)");
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
        if (mtp_ctx_) {
            try {
                follow(batch);
            } catch (...) {
                llama_batch_free(batch);
                throw;
            }
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

namespace kvf {

namespace {

// A batch of n tokens that also carries one hidden-state row per token (libllama's "MTP hook" batches).
llama_batch mtp_batch(int32_t n, size_t n_embd) {
    llama_batch b = llama_batch_init(n, 0, 1);
    b.embd = static_cast<float *>(std::malloc(sizeof(float) * (size_t) n * n_embd));   // llama_batch_free frees it
    if (!b.embd) {
        llama_batch_free(b);
        throw std::bad_alloc();
    }
    b.n_tokens = n;
    return b;
}

}  // namespace

void LlamaReference::follow(const llama_batch & batch) {
    const size_t E = pending_h_.size();
    const int32_t n = batch.n_tokens;
    const float * h = llama_get_embeddings_nextn(ctx_);   // [n, E]: the trunk's h_nextn of every token of the batch
    if (!h) throw std::runtime_error("libllama returned no h_nextn");
    llama_batch b = mtp_batch(n, E);
    for (int32_t i = 0; i < n; ++i) {
        b.token[i] = batch.token[i];
        b.pos[i] = batch.pos[i];
        b.n_seq_id[i] = 1;
        b.seq_id[i][0] = 0;
        b.logits[i] = false;
        std::memcpy(b.embd + (size_t) i * E, i == 0 ? pending_h_.data() : h + (size_t) (i - 1) * E, E * sizeof(float));
    }
    std::memcpy(pending_h_.data(), h + (size_t) (n - 1) * E, E * sizeof(float));
    const int rc = llama_decode(mtp_ctx_, b);
    llama_batch_free(b);
    if (rc != 0) throw std::runtime_error("llama_decode of the MTP context failed");
}

std::vector<float> LlamaReference::mtp_draft(const std::vector<int32_t> & tokens) {
    if (!mtp_ctx_) throw std::logic_error("mtp_draft needs a reference made with mtp=True");
    const size_t E = pending_h_.size();
    const int32_t nv = n_vocab();
    std::vector<float> h = pending_h_, out;
    for (size_t i = 0; i < tokens.size(); ++i) {
        if (tokens[i] < 0 || tokens[i] >= nv) throw std::invalid_argument("mtp_draft: token outside the vocabulary");
        llama_batch b = mtp_batch(1, E);
        b.token[0] = tokens[i];
        b.pos[0] = (llama_pos) (n_past_ + (int64_t) i);
        b.n_seq_id[0] = 1;
        b.seq_id[0][0] = 0;
        b.logits[0] = true;
        std::memcpy(b.embd, h.data(), E * sizeof(float));
        const int rc = llama_decode(mtp_ctx_, b);
        llama_batch_free(b);
        if (rc != 0) throw std::runtime_error("llama_decode of the MTP context failed");
        const float * l = llama_get_logits_ith(mtp_ctx_, 0);
        out.insert(out.end(), l, l + nv);
        const float * next = llama_get_embeddings_nextn_ith(mtp_ctx_, 0);
        if (!next) throw std::runtime_error("libllama returned no MTP h_nextn");
        h.assign(next, next + E);
    }
    llama_memory_seq_rm(llama_get_memory(mtp_ctx_), 0, (llama_pos) n_past_, -1);
    return out;
}

}  // namespace kvf
