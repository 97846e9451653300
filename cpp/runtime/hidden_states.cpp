#include "runtime/hidden_states.h"

#include <algorithm>
#include <stdexcept>
#include <utility>

namespace kvf {

HiddenStates::HiddenStates(ggml_backend_t backend, int64_t n_embd, int64_t start, int64_t n_prompt,
                           std::vector<Step> steps, bool pin, std::shared_ptr<HostMemory> kept)
    : host_(kept && kept->size() >= (size_t) (n_prompt * n_embd) * sizeof(float)
                ? std::move(kept) : std::make_shared<HostMemory>((size_t) (n_prompt * n_embd) * sizeof(float), pin)),
      n_embd_(n_embd), start_(start),
      steps_(std::move(steps)), backend_(backend) {
    ggml_backend_dev_t dev = ggml_backend_get_device(backend);
    ggml_backend_dev_props props;
    ggml_backend_dev_get_props(dev, &props);
    if (!host_->pinned() || !props.caps.async || !props.caps.events) return;   // the host path
    int64_t max_n = 0;
    for (const Step & s : steps_) max_n = std::max(max_n, s.n);
    ggml_init_params ip = {2 * ggml_tensor_overhead(), nullptr, true};
    ctx_ = ggml_init(ip);
    for (ggml_tensor *& t : tile_) t = ggml_new_tensor_2d(ctx_, GGML_TYPE_F32, n_embd, max_n);
    buf_ = ggml_backend_alloc_ctx_tensors(ctx_, backend);
    copy_ = ggml_backend_dev_init(dev, nullptr);
    for (ggml_backend_event_t & e : done_) e = ggml_backend_event_new(dev);
    computed_ = ggml_backend_event_new(dev);
    if (!buf_ || !copy_ || !done_[0] || !done_[1] || !computed_) {
        release();
        throw std::runtime_error("could not allocate the layer-major prefill's hidden-state tiles on the device");
    }
    produced_.assign(steps_.empty() ? 0 : (size_t) steps_.back().layer + 1, start);
    prefetch(1);
}

ggml_tensor * HiddenStates::input(ggml_context * ctx, size_t k, bool measure) {
    const Step & s = steps_.at(k);
    if (s.layer == 0) return nullptr;
    if (!copy_) {
        ggml_tensor * t = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_embd_, s.n);
        if (ggml_backend_tensor_alloc(host_->buffer(), t, rows(s)) != GGML_STATUS_SUCCESS) {
            throw std::runtime_error("could not place a tensor in host memory");
        }
        return t;
    }
    if (measure) return tile_view(ctx, k);
    prefetch(k);   // already queued, unless the step's rows were made just now
    if (queued_ <= k) throw std::logic_error("layer-major prefill: a step's input rows were not computed");
    return tile_view(ctx, k);
}

void HiddenStates::before_compute(size_t k) {
    if (copy_) ggml_backend_event_wait(backend_, done_[k % 2]);
}

ggml_tensor * HiddenStates::output(ggml_context * ctx, size_t k, ggml_tensor * y) {
    if (!copy_) {
        ggml_set_output(y);
        return y;
    }
    return ggml_cpy(ctx, y, tile_view(ctx, k));
}

void HiddenStates::queued(size_t k, ggml_tensor * y, const std::function<void(ggml_backend_t)> & also) {
    const Step & s = steps_.at(k);
    if (!copy_) {
        if (y) ggml_backend_tensor_get(y, rows(s), 0, ggml_nbytes(y));
        return;
    }
    ggml_backend_event_record(computed_, backend_);
    ggml_backend_event_wait(copy_, computed_);   // every copy queued from here on follows step k
    if (y) {
        ggml_backend_tensor_get_async(copy_, tile_[k % 2], rows(s), 0, (size_t) (s.n * n_embd_) * sizeof(float));
        ggml_backend_event_record(done_[k % 2], copy_);
        produced_[(size_t) s.layer] = s.p0 + s.n;
    }
    if (also) also(copy_);
    prefetch(k + 2);   // the tile step k used is free now
}

void HiddenStates::synchronize_copies() const {
    if (copy_) ggml_backend_synchronize(copy_);
}

float * HiddenStates::rows(const Step & s) const {
    return reinterpret_cast<float *>(host_->data()) + (s.p0 - start_) * n_embd_;
}

ggml_tensor * HiddenStates::tile_view(ggml_context * ctx, size_t k) {
    ggml_tensor * t = tile_[k % 2];
    return ggml_view_2d(ctx, t, n_embd_, steps_[k].n, t->nb[1], 0);
}

void HiddenStates::prefetch(size_t last) {
    for (; queued_ <= last && queued_ < steps_.size(); ++queued_) {
        const Step & s = steps_[queued_];
        if (s.layer == 0) continue;
        if (produced_[(size_t) s.layer - 1] < s.p0 + s.n) return;   // a step still to run makes them
        ggml_backend_tensor_set_async(copy_, tile_[queued_ % 2], rows(s), 0, (size_t) (s.n * n_embd_) * sizeof(float));
        ggml_backend_event_record(done_[queued_ % 2], copy_);
    }
}

void HiddenStates::release() {
    if (copy_) ggml_backend_synchronize(copy_);   // nothing may still copy into memory about to go
    for (ggml_backend_event_t * e : {&done_[0], &done_[1], &computed_}) {
        if (*e) ggml_backend_event_free(*e);
        *e = nullptr;
    }
    if (copy_) ggml_backend_free(copy_);
    if (buf_) ggml_backend_buffer_free(buf_);
    if (ctx_) ggml_free(ctx_);
    copy_ = nullptr;
    buf_ = nullptr;
    ctx_ = nullptr;
}

}  // namespace kvf
