// SlidingWindowKV: the K/V of a model's sliding-window layers (gemma3's local layers), one ring per layer.
//
// A sliding-window layer's query at position p sees only keys at p - window < q <= p, so the layer never
// needs more than its window plus the step being written: position p lives in ring row p % ring_tokens,
// written with set_rows like the pool, and the mask hides every row by position (outside the window, not
// yet written, or forgotten). With ring_tokens >= window + step a step's writes only overwrite positions
// that no query of the step can see. Nothing here pages: the pager, the scorers and the host store see
// the global layers alone, as llama.cpp's iswa cache keeps a window + ubatch cache beside the full one.
//
// A ring has window + n_batch rows, rounded up to the n_kv padding and the chunk (ring_tokens_for); a step writes
// at most ring_tokens - window tokens (max_step; Session::step_tokens caps a step by it). Once a ring has wrapped,
// its keys are out of position order: that changes the summation order only (on Gemma 3 270M logits moved by ~1
// in ~100, greedy tokens did not).
//
// What a ring cannot do is go back further than it holds: forgetting positions >= n is exact only while
// the window before n is still in the ring (can_truncate). Callers that cannot truncate start over, and a
// prefix snapshot older than the ring's reach is refused.
//
// Invariants: rows hold positions [n_tokens - ring_tokens, n_tokens) (those >= 0), row p % ring_tokens holds p;
// slot_pos[r] is -1 for a row that holds nothing visible. Every ring layer holds the same positions.
#pragma once

#include "kv/context_memory.h"
#include "kv/kv_step_inputs.h"
#include "kv/pooled_kv.h"

#include <cstdint>
#include <memory>
#include <vector>

namespace kvf {

class SlidingWindowKV : public ContextMemory {
public:
    // layout: the ring layers' row widths and types; its n_layer is the number of sliding-window layers
    // and its pool_tokens the ring size (ring_tokens_for). window: positions a query sees, itself included.
    SlidingWindowKV(const LayerBackends & backends, const KvLayout & layout, int64_t window, int64_t kv_pad);
    // The ring size for steps of up to max_step tokens: window + max_step, rounded up to kv_pad and to chunks.
    static int64_t ring_tokens_for(int64_t window, int64_t max_step, int64_t kv_pad, int64_t chunk_tokens);

    const PooledKV & kv() const { return *kv_; }
    int64_t window() const { return window_; }
    int64_t ring_tokens() const { return kv_->layout().pool_tokens; }
    int64_t max_step() const override { return ring_tokens() - window_; }   // tokens one step may write
    int64_t n_tokens() const override { return n_tokens_; }
    int64_t device_bytes() const override { return kv_->device_bytes(); }
    int64_t device_bytes_on(ggml_backend_t backend) const override { return kv_->device_bytes_on(backend); }

    // Positions [start, start+n) are written next (start == n_tokens(), n <= max_step()): their rows, as
    // an alloc plan's span for kv_step_inputs_set. The ring's bookkeeping moves to n_tokens() = start+n.
    Plan place(int64_t start, int64_t n);
    // The rows a step attends (the first n_kv of the ring) and the position each holds, with the window.
    KvKeyOrder key_order() const;
    // A step's place() and key order, kept for its graph's inputs (step_plan, step_order) until the next.
    void place_step(int64_t start, int64_t n) override;
    void unplace_step(int64_t start) override;   // back to the ring before the step's place_step
    const Plan & step_plan() const { return step_plan_; }
    const KvKeyOrder & step_order() const { return step_order_; }

    // Whether forgetting positions >= n keeps everything a query at n sees.
    bool can_truncate(int64_t n) const override;
    void truncate(int64_t n) override;   // throws std::invalid_argument unless can_truncate(n)
    int64_t rewind_point(int64_t n) const override;   // n where the window before it is still held, else 0
    void clear() override;
    // The bookkeeping and, once anything is held, every row's bytes (a prompt extending held positions overwrites
    // rows their windows still need).
    std::unique_ptr<SavePoint> save_point() const override;
    void roll_back(const SavePoint & p) override;
    // The bookkeeping alone, for layer-major prefill, which writes the same positions into one layer after another.
    struct Mark { int64_t n_tokens; std::vector<int64_t> slot_pos; };
    Mark mark() const { return {n_tokens_, slot_pos_}; }
    void rewind_to(const Mark & m) { n_tokens_ = m.n_tokens; slot_pos_ = m.slot_pos; }
    // Every row's bytes, every layer (host memory of the ring's size): a layer-major prefill that extends held
    // positions overwrites rows their windows still need, so it keeps these to put back if it fails.
    std::vector<uint8_t> copy_rows() const;
    void restore_rows(const std::vector<uint8_t> & rows);

    // ---- state: window, ring_tokens, n_tokens, slot positions, then the rings (PooledKV state, every block) ----
    static constexpr uint32_t k_state_version = 1;
    // The ring as truncating to n_tokens would leave it (the live ring is not touched); needs can_truncate.
    void save_state(ByteWriter & w, int64_t n_tokens) const;
    struct Saved {
        int64_t n_tokens = 0;
        std::vector<int64_t> slot_pos;
        std::vector<const uint8_t *> blocks;
    };
    // Checks the saved ring fits this one (window, size, layout) and holds n_tokens. Changes nothing.
    Saved state_from(ByteReader & r, uint32_t version, int64_t n_tokens) const;
    void load_state(const Saved & s);

private:
    std::vector<int64_t> all_blocks() const;   // 0, 1, ..., every block of the ring (its state is all of them)

    std::unique_ptr<PooledKV> kv_;
    int64_t window_, kv_pad_;
    int64_t n_tokens_ = 0;
    std::vector<int64_t> slot_pos_;
    Mark step_mark_;          // the ring before the step placed last (its written rows hold no reachable position)
    Plan step_plan_;
    KvKeyOrder step_order_;
};

}  // namespace kvf
