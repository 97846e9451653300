// Tensors that live on several backends (a model split across devices): one no_alloc context per backend, each
// allocated as one buffer of that backend. The pool, an arena, the recurrent state: each layer's tensors are made
// in the context of the layer's device, then allocate() places them all.
#pragma once

#include "ggml.h"
#include "ggml-backend.h"

#include <cstdint>
#include <string>
#include <vector>

namespace kvf {

// The backend of each layer of some per-layer state (a model split across devices keeps each layer's K/V or
// state with its weights); one entry: every layer's. per_layer() spells it out for n layers.
using LayerBackends = std::vector<ggml_backend_t>;
LayerBackends per_layer(const LayerBackends & backends, int64_t n_layer);   // std::invalid_argument on a size mismatch
std::vector<ggml_backend_t> distinct(const LayerBackends & backends);      // each once, in order

class BackendBuffers {
public:
    explicit BackendBuffers(size_t max_tensors) : max_tensors_(max_tensors) {}
    ~BackendBuffers();
    BackendBuffers(const BackendBuffers &) = delete;
    BackendBuffers & operator=(const BackendBuffers &) = delete;

    ggml_context * ctx(ggml_backend_t backend);   // where tensors for `backend` are made (at most max_tensors each)
    // Allocates every context's tensors on its backend and zeroes them. std::runtime_error naming `what`, the bytes
    // and the backend when one does not fit (what was allocated before stays owned, freed with this object).
    void allocate(const std::string & what);
    void clear();   // zero every allocated buffer
    int64_t bytes() const;
    int64_t bytes_on(ggml_backend_t backend) const;
    const std::vector<ggml_backend_t> & backends() const { return backends_; }   // in the order first asked for

private:
    size_t max_tensors_;
    std::vector<ggml_backend_t> backends_;
    std::vector<ggml_context *> ctxs_;
    std::vector<ggml_backend_buffer_t> bufs_;
};

}  // namespace kvf
