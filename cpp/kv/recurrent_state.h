// RecurrentState: the fixed-size memory of a model's linear-attention layers (qwen35's gated delta-net).
//
// A linear-attention layer carries no K/V that grows with the context: per layer, a conv state (the last
// d_conv - 1 inputs of every conv channel) and a recurrent state ([head_v, head_v, n_v_heads]) that each
// step reads and overwrites in place. Nothing here pages or is scored: the pool, the pager and the scorers
// see only the full-attention layers, and this state stays resident beside them.
//
// What the state cannot do is go back: it describes exactly the tokens it has consumed, all of them. So
// forgetting positions is exact only to the end (nothing forgotten) or to 0 (start over); any other
// truncate is refused, and callers (the engine's rewind, prefix reuse, snapshots) start over instead.
// That is a cost, written in docs/DESIGN.md: a prompt sharing only part of the held history recomputes
// from position 0, as libllama does without its recurrent-state checkpoints.
//
// Invariant: the state holds exactly the first n_tokens() positions of its session.
#pragma once

#include "ggml.h"
#include "ggml-backend.h"

#include <cstdint>
#include <vector>

namespace kvf {

class ByteReader;
class ByteWriter;

class RecurrentState {
public:
    // n_layer recurrent layers, each an F32 conv state of conv_elems and an F32 recurrent state of ssm_elems.
    RecurrentState(ggml_backend_t backend, int64_t n_layer, int64_t conv_elems, int64_t ssm_elems);
    ~RecurrentState();
    RecurrentState(const RecurrentState &) = delete;
    RecurrentState & operator=(const RecurrentState &) = delete;

    ggml_tensor * conv(int64_t l) const { return conv_[(size_t) l]; }   // F32 [conv_elems], layer l of its kind
    ggml_tensor * ssm(int64_t l) const { return ssm_[(size_t) l]; }     // F32 [ssm_elems]
    int64_t n_layer() const { return (int64_t) conv_.size(); }
    int64_t n_tokens() const { return n_tokens_; }
    int64_t device_bytes() const;

    // Positions [start, start+n) are consumed next (start == n_tokens()): the graph about to run writes them.
    void place(int64_t start, int64_t n);
    bool can_truncate(int64_t n) const { return n == n_tokens_ || n == 0; }
    void truncate(int64_t n);   // throws std::invalid_argument unless can_truncate(n)
    void clear();               // zero state, nothing consumed

    // Every byte of the state (all layers, conv then recurrent) and its token count: a copy to go back to.
    struct Copy {
        int64_t n_tokens = 0;
        std::vector<uint8_t> bytes;
    };
    Copy copy() const;
    void restore(const Copy & c);

    // ---- state: n_layer, conv and recurrent sizes, n_tokens, then every byte ----
    static constexpr uint32_t k_state_version = 1;
    // Only the whole state exists: n_tokens must be n_tokens() (throws SnapshotError otherwise).
    void save_state(ByteWriter & w, int64_t n_tokens) const;
    // Checks the saved state fits this one and holds n_tokens. Changes nothing.
    Copy state_from(ByteReader & r, uint32_t version, int64_t n_tokens) const;

private:
    size_t total_bytes() const;

    ggml_context * ctx_ = nullptr;
    ggml_backend_buffer_t buf_ = nullptr;
    std::vector<ggml_tensor *> conv_, ssm_;
    int64_t conv_elems_, ssm_elems_;
    int64_t n_tokens_ = 0;
};

}  // namespace kvf
