// The layer-major exact prefill's hidden states between layers (runtime/session_prefill.cpp): every prompt
// position's row in host memory, as the prompt goes through one layer after another in steps (layer,
// positions). On a GPU with events, two device tiles carry the steps' rows, and a second stream (a second
// backend on the same device) fills a tile with a step's input and drains its output while the compute stream
// works on the other tile: those copies (16 KiB per token per layer each way on an 8B model) overlap the compute
// instead of adding to it, and no step has to wait on the host for the one before it (the streams wait on each
// other's events). Elsewhere a step's graph reads its rows from host memory in place and its output is read back.
#pragma once

#include "common/host_memory.h"

#include "ggml-backend.h"
#include "ggml.h"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace kvf {

class HiddenStates {
public:
    struct Step {
        int layer;
        int64_t p0, n;   // positions [p0, p0 + n)
    };

    // start, n_prompt: the positions whose rows are kept; pin: host memory the device can copy from directly.
    // kept: host memory made before the prompt (Session::reserve_host), taken where it holds n_prompt rows: pinning
    // runs at ~8 GiB/s, 64 ms of a 32K prompt's 3.8 s on the 8B shape (R131); else rows of its own.
    HiddenStates(ggml_backend_t backend, int64_t n_embd, int64_t start, int64_t n_prompt, std::vector<Step> steps,
                 bool pin, std::shared_ptr<HostMemory> kept = nullptr);
    ~HiddenStates() { release(); }
    HiddenStates(const HiddenStates &) = delete;
    HiddenStates & operator=(const HiddenStates &) = delete;

    const HostMemory & host() const { return *host_; }
    bool own_rows() const { return host_.use_count() == 1; }   // false: the session keeps them too (kept)
    bool overlaps() const { return copy_ != nullptr; }   // false: every step runs to its end before the next
    int64_t device_bytes() const { return buf_ ? (int64_t) ggml_backend_buffer_get_size(buf_) : 0; }

    // Step k's input for its graph (none for layer 0): a view of its device tile, or its host rows in place.
    // measure: for a graph only measured, never run: nothing is queued.
    ggml_tensor * input(ggml_context * ctx, size_t k, bool measure = false);
    // Before step k's graph is queued: the compute stream waits for the copies on the step's tile.
    void before_compute(size_t k);
    // What step k's graph computes to hand its output y on: a copy into the step's tile (written in place
    // of its input, which nothing reads after y), or y itself.
    ggml_tensor * output(ggml_context * ctx, size_t k, ggml_tensor * y);
    // After step k's graph was queued (overlapping) or has run (the host path): its output y (none on the
    // last layer) goes to host memory once computed, then `also` (overlapping only) queues on the copy stream what
    // else is to leave the device once step k ran (its K/V), and the copies of the steps ahead are queued. Queued
    // ahead of those inputs, `also`'s copies have read what they copy before a later step's input is in its
    // tile, hence before any later step that waits for it (before_compute) overwrites it.
    void queued(size_t k, ggml_tensor * y, const std::function<void(ggml_backend_t)> & also = {});
    void synchronize_copies() const;   // every copy queued on the copy stream has ended

private:
    float * rows(const Step & s) const;
    ggml_tensor * tile_view(ggml_context * ctx, size_t k);
    // Queues the inputs of steps up to `last`, in order, as far as the rows they need have been produced.
    // The copy stream is in order, and step j's tile was last used by step j - 2, which the copy stream
    // follows once queued(j - 2) ran: the only place that queues step j's input before step j - 1 is queued.
    void prefetch(size_t last);
    void release();

    std::shared_ptr<HostMemory> host_;
    int64_t n_embd_, start_;
    std::vector<Step> steps_;
    ggml_context * ctx_ = nullptr;
    ggml_backend_buffer_t buf_ = nullptr;
    ggml_tensor * tile_[2] = {nullptr, nullptr};
    ggml_backend_t backend_;   // the compute stream's
    ggml_backend_t copy_ = nullptr;
    ggml_backend_event_t done_[2] = {nullptr, nullptr};   // recorded after the last copy queued on each tile
    ggml_backend_event_t computed_ = nullptr;             // recorded after the last step queued
    std::vector<int64_t> produced_;   // per layer: its output rows are queued to host memory up to here
    size_t queued_ = 0;               // steps whose inputs are queued (or need none)
};

}  // namespace kvf
