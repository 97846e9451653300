// RecurrentState: the fixed-size memory of a model's linear-attention layers (qwen35's gated delta-net).
//
// A linear-attention layer carries no K/V that grows with the context: per layer, a conv state (the last
// d_conv - 1 inputs of every conv channel) and a recurrent state ([head_v, head_v, n_v_heads]) that each
// step reads and overwrites in place. Nothing here pages or is scored: the pool, the pager and the scorers
// see only the full-attention layers, and this state stays resident beside them.
//
// What the state cannot do is go back: it describes exactly the tokens it has consumed, all of them. So
// forgetting positions is exact only to the end (nothing forgotten), to 0 (start over), or to a checkpoint:
// a host copy of the whole state taken at some position (checkpoint(); the engine takes one before the
// last token of every prompt, so the next turn or a rerun of the prompt restarts there, and one at the end of a
// layer-major prompt, so a resend of it is answered from there). The newest
// k_max_checkpoints are kept. Any other truncate is refused; callers go back to rewind_point(n), the
// latest position <= n they can reach exactly, and recompute from there.
//
// The multi-token-prediction head's carry (model/mtp.h: the trunk's last output-normed hidden state) is state of the
// same kind, exact only for everything consumed: when a session runs the head, it is one more tensor here, so
// checkpoints, the stash, truncation and snapshots carry it with the layers' state.
//
// Invariants: the state holds exactly the first n_tokens() positions of its session; every checkpoint
// holds the state after its first n positions of the same tokens (n <= n_tokens()), sorted by n.
#pragma once

#include "ggml.h"
#include "ggml-backend.h"
#include "common/backend_buffers.h"
#include "kv/context_memory.h"

#include <cstdint>
#include <memory>
#include <vector>

namespace kvf {

class ByteReader;
class ByteWriter;
class PoolArena;

class RecurrentState : public ContextMemory {
public:
    // n_layer recurrent layers, each an F32 conv state of conv_elems and an F32 recurrent state of ssm_elems, on
    // its backend (backends: one per layer, or one for all); carry_elems > 0: the MTP head's carry too (F32,
    // n_embd), on carry_backend (nullptr: the last layer's).
    RecurrentState(const LayerBackends & backends, int64_t n_layer, int64_t conv_elems, int64_t ssm_elems,
                   int64_t carry_elems = 0, ggml_backend_t carry_backend = nullptr);
    // The same, the layers' state in lane `lane` of `arena` (the lane of the session's pool; kv/pool_arena.h), zeroed;
    // the carry, the checkpoints and the stash stay the session's own.
    RecurrentState(const LayerBackends & backends, int64_t n_layer, int64_t conv_elems, int64_t ssm_elems,
                   int64_t carry_elems, ggml_backend_t carry_backend, std::shared_ptr<PoolArena> arena, int64_t lane);
    ~RecurrentState();
    RecurrentState(const RecurrentState &) = delete;
    RecurrentState & operator=(const RecurrentState &) = delete;

    ggml_tensor * conv(int64_t l) const { return conv_[(size_t) l]; }   // F32 [conv_elems] ([conv_elems, 1] in an arena)
    ggml_tensor * ssm(int64_t l) const { return ssm_[(size_t) l]; }     // F32 [ssm_elems]
    ggml_tensor * mtp_carry() const { return carry_; }                  // F32 [carry_elems] (nullptr: none)
    int64_t n_layer() const { return (int64_t) conv_.size(); }
    const PoolArena * arena() const { return arena_.get(); }   // nullptr: the state has memory of its own
    int64_t lane() const { return lane_; }                       // its lane in arena() (-1: none)
    int64_t n_tokens() const override { return n_tokens_; }
    int64_t device_bytes() const override;
    int64_t device_bytes_on(ggml_backend_t backend) const override;

    // Positions [start, start+n) are consumed next (start == n_tokens()): the graph about to run writes them.
    void place_step(int64_t start, int64_t n) override;
    // Forget the positions [start, n_tokens()) the last place_step() gave a graph that never ran (a batched step that
    // failed before its compute): the state's bytes have not moved, so this is exact, unlike a truncate.
    void unplace_step(int64_t start) override;
    bool can_truncate(int64_t n) const override;
    // Back to n: nothing (the end), zero state (0), or the checkpoint at n; later checkpoints are dropped.
    void truncate(int64_t n) override;   // throws std::invalid_argument unless can_truncate(n)
    void clear() override;               // zero state, nothing consumed, no checkpoints
    // Keep a copy of the state at n_tokens() (host memory; the oldest goes beyond k_max_checkpoints).
    static constexpr size_t k_max_checkpoints = 3;   // a prompt's end and the token before, the last turn's
    void checkpoint();
    // A copy of the state at n_tokens() on the device itself (a second buffer of the state's size, made on first
    // use): speculative decoding stashes before a verify step and goes back here when drafts are rejected. It
    // counts as a point truncate reaches, until a truncate goes below it.
    void stash();
    int64_t rewind_point(int64_t n) const override;   // the latest position <= n that truncate reaches
    int64_t checkpoint_bytes() const;        // host memory the checkpoints hold

    // Every byte of the state (all layers, conv then recurrent; the carry last) and its token count: a copy to go back to.
    struct Copy {
        int64_t n_tokens = 0;
        std::vector<uint8_t> bytes;
    };
    Copy copy() const;
    // A checkpoint made part by part while a layer-major prefill runs each layer past position n: blank(n) is sized
    // as copy() is; copy_part_into puts layer l's conv and recurrent state (l = n_layer(): the carry) where copy()
    // puts them; add_checkpoint keeps it as checkpoint() keeps a copy (c.n_tokens <= n_tokens(), the same tokens).
    Copy blank(int64_t n) const;
    void copy_part_into(int64_t l, Copy & c) const;
    void add_checkpoint(Copy c);
    void restore(const Copy & c);   // another session's state (a snapshot): drops the checkpoints
    void rewind_to(const Copy & c);  // this state as copy() took it earlier: keeps the checkpoints up to it
    // A copy() (host memory, the state's size: ~150 MiB on Qwen3.5-27B's shape) and rewind_to it.
    std::unique_ptr<SavePoint> save_point() const override;
    void roll_back(const SavePoint & p) override;

    // ---- state: n_layer, conv and recurrent sizes, the carry's size (version 2), n_tokens, then every byte ----
    static constexpr uint32_t k_state_version = 2;
    // Only the whole state exists: n_tokens must be n_tokens() (throws SnapshotError otherwise).
    void save_state(ByteWriter & w, int64_t n_tokens) const;
    // Checks the saved state fits this one and holds n_tokens. Changes nothing.
    Copy state_from(ByteReader & r, uint32_t version, int64_t n_tokens) const;

private:
    size_t total_bytes() const;
    static void check_sizes(int64_t n_layer, int64_t conv_elems, int64_t ssm_elems, int64_t carry_elems);
    void make_carry(const LayerBackends & on, int64_t carry_elems, ggml_backend_t carry_backend);
    int64_t lane_bytes_on(ggml_backend_t backend) const;   // of the arena lane's views (nullptr: on every backend)

    BackendBuffers bufs_;                   // every tensor, or (in an arena) the carry only
    std::shared_ptr<PoolArena> arena_;
    int64_t lane_ = -1;
    std::unique_ptr<ggml_context, decltype(&ggml_free)> view_ctx_{nullptr, ggml_free};   // the lane views (in an arena)
    std::vector<ggml_backend_t> backend_of_;   // each tensor of tensors()'s
    std::vector<ggml_tensor *> conv_, ssm_;
    ggml_tensor * carry_ = nullptr;
    int64_t conv_elems_, ssm_elems_, carry_elems_;
    int64_t n_tokens_ = 0;
    std::vector<Copy> checkpoints_;
    // the stash: buffers of its own, a twin of every state tensor on the same backend; stash_n_ < 0: nothing stashed
    std::unique_ptr<BackendBuffers> stash_bufs_;
    std::vector<ggml_tensor *> stash_;
    int64_t stash_n_ = -1;
    void load(const Copy & c);
    std::vector<ggml_tensor *> tensors() const;   // conv 0, ssm 0, conv 1, ssm 1, ..., the carry
};

}  // namespace kvf
