// Session's attention capture: the latest step's attention probabilities, mapped from attended key
// order back to positions, for the drafter scorer.
#include "runtime/session.h"

#include <algorithm>
#include <stdexcept>

namespace kvf {

std::vector<float> AttentionCapture::max_over_queries() const {
    std::vector<float> out((size_t) n_positions, 0.0f);
    for (int64_t i = 0; i < n_q; ++i) {
        const float * row = data.data() + i * n_positions;
        for (int64_t p = 0; p < n_positions; ++p) out[p] = std::max(out[p], row[p]);
    }
    return out;
}

void Session::keep_capture_order(const KvKeyOrder & order) {
    attn_key_pos_.assign(order.key_pos.begin(), order.key_pos.begin() + order.n_kv);
    attn_n_tokens_ = pager_->n_tokens();
}

AttentionCapture Session::attention_capture() const {
    const SessionLock held = lock();
    if (!cfg_.capture_attention) {
        throw std::logic_error("attention_capture needs a session made with capture_attention=True");
    }
    // A truncate (or reset) since the step leaves the capture describing tokens no longer held.
    if (graph_.attn.empty() || shape_[0] < 0 || attn_n_tokens_ != pager_->n_tokens()) {
        throw std::logic_error("no attention captured for the tokens held: run forward first");
    }
    AttentionCapture c;
    const int64_t n_kv = graph_.attn[0]->ne[0];
    c.n_q = graph_.attn[0]->ne[1];
    c.n_positions = pager_->n_tokens();
    c.data.assign((size_t) (c.n_q * c.n_positions), 0.0f);
    std::vector<float> layer((size_t) (n_kv * c.n_q));
    for (const ggml_tensor * t : graph_.attn) {   // [n_kv, n_q] per layer
        ggml_backend_tensor_get(t, layer.data(), 0, ggml_nbytes(t));
        for (int64_t j = 0; j < n_kv; ++j) {
            const int64_t p = attn_key_pos_[j];
            if (p < 0 || p >= c.n_positions) continue;   // empty (padding) slot
            for (int64_t i = 0; i < c.n_q; ++i) {
                float & out = c.data[(size_t) (i * c.n_positions + p)];
                out = std::max(out, layer[(size_t) (i * n_kv + j)]);
            }
        }
    }
    return c;
}

}  // namespace kvf
