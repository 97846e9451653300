#include "common/backend_buffers.h"

#include <algorithm>
#include <stdexcept>

namespace kvf {

LayerBackends per_layer(const LayerBackends & backends, int64_t n_layer) {
    if (backends.size() == 1) return LayerBackends((size_t) n_layer, backends[0]);
    if ((int64_t) backends.size() != n_layer) {
        throw std::invalid_argument(std::to_string(backends.size()) + " layer backends for " + std::to_string(n_layer) +
                                    " layers");
    }
    return backends;
}

std::vector<ggml_backend_t> distinct(const LayerBackends & backends) {
    std::vector<ggml_backend_t> out;
    for (ggml_backend_t b : backends) if (std::find(out.begin(), out.end(), b) == out.end()) out.push_back(b);
    return out;
}

BackendBuffers::~BackendBuffers() {
    for (ggml_backend_buffer_t b : bufs_) if (b) ggml_backend_buffer_free(b);
    for (ggml_context * c : ctxs_) ggml_free(c);
}

ggml_context * BackendBuffers::ctx(ggml_backend_t backend) {
    for (size_t i = 0; i < backends_.size(); ++i) if (backends_[i] == backend) return ctxs_[i];
    ggml_init_params params = {ggml_tensor_overhead() * (max_tensors_ + 1), nullptr, true};
    ggml_context * c = ggml_init(params);
    if (!c) throw std::runtime_error("could not make a ggml context");
    backends_.push_back(backend);
    ctxs_.push_back(c);
    bufs_.push_back(nullptr);
    return c;
}

void BackendBuffers::allocate(const std::string & what) {
    for (size_t i = 0; i < backends_.size(); ++i) {
        if (bufs_[i]) continue;
        bufs_[i] = ggml_backend_alloc_ctx_tensors(ctxs_[i], backends_[i]);
        if (!bufs_[i]) {
            size_t n = 0;
            for (ggml_tensor * t = ggml_get_first_tensor(ctxs_[i]); t; t = ggml_get_next_tensor(ctxs_[i], t)) n += ggml_nbytes(t);
            throw std::runtime_error("could not allocate " + std::to_string(n) + " bytes for " + what + " on " +
                                     ggml_backend_name(backends_[i]));
        }
        // Unwritten rows are masked, but -inf * garbage could still poison a sum: start from zeros.
        ggml_backend_buffer_clear(bufs_[i], 0);
    }
}

void BackendBuffers::clear() {
    for (ggml_backend_buffer_t b : bufs_) if (b) ggml_backend_buffer_clear(b, 0);
}

int64_t BackendBuffers::bytes() const {
    int64_t n = 0;
    for (ggml_backend_buffer_t b : bufs_) if (b) n += (int64_t) ggml_backend_buffer_get_size(b);
    return n;
}

int64_t BackendBuffers::bytes_on(ggml_backend_t backend) const {
    for (size_t i = 0; i < backends_.size(); ++i) {
        if (backends_[i] == backend) return bufs_[i] ? (int64_t) ggml_backend_buffer_get_size(bufs_[i]) : 0;
    }
    return 0;
}

}  // namespace kvf
