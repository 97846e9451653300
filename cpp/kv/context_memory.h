// ContextMemory: what a session asks of each memory it keeps beside the pool for one context: the sliding-window
// rings (SlidingWindowKV) and the linear-attention state (RecurrentState). Both are resident, fixed in size, never
// paged or scored, and both reach back only so far (a ring: its window; the state: its checkpoints). The session
// keeps a list of the ones its model has and loops over it to go back, start over, count bytes and roll back a
// failed prompt, and to place a step's positions (and take them back from a graph that never ran), as llama.cpp's
// llama_memory_i lets its context treat every cache alike. What differs between them stays in their own classes:
// what a placed step needs in its graph (a ring's rows and key order; the state: nothing but its count) and their
// snapshot sections (each its own tag and version).
//
// The pool is not one of these: its positions are placed and dropped through the pager's plans (plan, then
// apply), which also page and reselect.
#pragma once

#include "ggml-backend.h"

#include <cstdint>
#include <limits>
#include <memory>

namespace kvf {

class ContextMemory {
public:
    virtual ~ContextMemory() = default;

    virtual int64_t n_tokens() const = 0;          // positions it describes: [0, n_tokens)
    // Whether forgetting positions >= n leaves exactly what having consumed the first n would.
    virtual bool can_truncate(int64_t n) const = 0;
    virtual void truncate(int64_t n) = 0;          // throws std::invalid_argument, changing nothing, unless can_truncate(n)
    virtual int64_t rewind_point(int64_t n) const = 0;   // the latest position <= n it can truncate to (0 always works)
    virtual void clear() = 0;                      // nothing consumed
    virtual int64_t device_bytes() const = 0;
    virtual int64_t device_bytes_on(ggml_backend_t backend) const = 0;

    // A step's positions [start, start + n) (start == n_tokens(), n <= max_step()) are written by the graph about to
    // run; unplace_step(start) forgets them if it never ran (exact: no byte has moved yet).
    virtual int64_t max_step() const { return std::numeric_limits<int64_t>::max(); }
    virtual void place_step(int64_t start, int64_t n) = 0;
    virtual void unplace_step(int64_t start) = 0;

    // The memory as it stands (bookkeeping and bytes), to put back if a layer-major prompt fails: its layers write
    // positions one layer after another, so no truncate can undo a prompt stopped between them.
    struct SavePoint {
        virtual ~SavePoint() = default;
    };
    virtual std::unique_ptr<SavePoint> save_point() const = 0;
    virtual void roll_back(const SavePoint & p) = 0;   // p from this memory's save_point()
};

}  // namespace kvf
