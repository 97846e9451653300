#include "kv/pool_arena.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace kvf {

namespace {

bool same_layout(const KvLayout & a, const KvLayout & b) {
    return a.n_layer == b.n_layer && a.n_embd_k == b.n_embd_k && a.n_embd_v == b.n_embd_v &&
           a.pool_tokens == b.pool_tokens && a.chunk_tokens == b.chunk_tokens && a.type_k == b.type_k &&
           a.type_v == b.type_v && a.v_trans == b.v_trans;
}

std::string describe(const KvLayout & L) {
    return std::to_string(L.n_layer) + " layers, pool " + std::to_string(L.pool_tokens) + ", K " +
           ggml_type_name(L.type_k) + " x " + std::to_string(L.n_embd_k) + ", V " + ggml_type_name(L.type_v) + " x " +
           std::to_string(L.n_embd_v) + (L.v_trans ? " transposed" : "");
}

// Columns [lane, lane + n) of a per-lane tensor [elems, n_lanes].
ggml_tensor * lane_columns(ggml_context * ctx, ggml_tensor * t, int64_t lane, int64_t n) {
    return ggml_view_2d(ctx, t, t->ne[0], n, t->nb[1], (size_t) lane * t->nb[1]);
}

ggml_tensor * bind(ggml_tensor * view) {
    if (ggml_backend_view_init(view) != GGML_STATUS_SUCCESS) throw std::runtime_error("PoolArena: could not bind a lane view");
    return view;
}

}  // namespace

PoolArena::PoolArena(int64_t n_lanes) : n_lanes_(n_lanes), taken_((size_t) std::max<int64_t>(n_lanes, 0), false) {
    if (n_lanes <= 0) throw std::invalid_argument("a pool arena needs at least one lane, got " + std::to_string(n_lanes));
}

PoolArena::~PoolArena() = default;

void PoolArena::allocate(const LayerBackends & backends, const KvLayout & L) {
    auto bufs = std::make_unique<BackendBuffers>((size_t) (2 * L.n_layer));
    std::vector<ggml_tensor *> k, v;
    const int64_t rows = L.pool_tokens * n_lanes_;
    for (int64_t il = 0; il < L.n_layer; ++il) {
        ggml_context * c = bufs->ctx(backends[(size_t) il]);
        k.push_back(ggml_new_tensor_2d(c, L.type_k, L.n_embd_k, rows));
        v.push_back(L.v_trans ? ggml_new_tensor_2d(c, L.type_v, L.pool_tokens, L.n_embd_v * n_lanes_)
                              : ggml_new_tensor_2d(c, L.type_v, L.n_embd_v, rows));
        ggml_format_name(k.back(), "arena_k_%d", (int) il);
        ggml_format_name(v.back(), "arena_v_%d", (int) il);
    }
    bufs->allocate("the pools of " + std::to_string(n_lanes_) + " sessions");   // throws: nothing is kept
    bufs_ = std::move(bufs);
    k_ = std::move(k);
    v_ = std::move(v);
    layout_ = L;
    backends_ = backends;
}

int64_t PoolArena::acquire(const LayerBackends & backends, const KvLayout & layout) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!bufs_) {
        allocate(backends, layout);
    } else if (backends != backends_ || !same_layout(layout, layout_)) {
        throw std::invalid_argument("a session joining a pool arena must have the pool of the sessions already in it (" +
                                    describe(layout_) + "), got " + describe(layout));
    }
    for (int64_t lane = 0; lane < n_lanes_; ++lane) {
        if (taken_[lane]) continue;
        taken_[lane] = true;
        return lane;
    }
    throw std::invalid_argument("every lane of the pool arena is taken (" + std::to_string(n_lanes_) + " sessions)");
}

void PoolArena::release(int64_t lane) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (lane >= 0 && lane < n_lanes_) taken_[lane] = false;
}

int64_t PoolArena::lanes_free() const {
    std::lock_guard<std::mutex> lock(mutex_);
    int64_t n = 0;
    for (bool t : taken_) n += !t;
    return n;
}

int64_t PoolArena::device_bytes() const {
    int64_t n = recurrent_bufs_ ? recurrent_bufs_->bytes() : 0;
    for (size_t il = 0; il < k_.size(); ++il) n += (int64_t) (ggml_nbytes(k_[il]) + ggml_nbytes(v_[il]));
    return n;
}

void PoolArena::reserve_recurrent(const LayerBackends & backends, int64_t n_layer, int64_t conv_elems, int64_t ssm_elems) {
    std::lock_guard<std::mutex> lock(mutex_);
    const LayerBackends on = per_layer(backends, n_layer);
    if (recurrent_bufs_) {
        if (on != recurrent_backends_ || n_layer != (int64_t) conv_.size() || conv_elems != conv_[0]->ne[0] ||
            ssm_elems != ssm_[0]->ne[0]) {
            throw std::invalid_argument("a session joining a pool arena must have the recurrent state of the sessions "
                                        "already in it (" + std::to_string(conv_.size()) + " layers of " +
                                        std::to_string(conv_[0]->ne[0]) + " + " + std::to_string(ssm_[0]->ne[0]) +
                                        " values), got " + std::to_string(n_layer) + " of " +
                                        std::to_string(conv_elems) + " + " + std::to_string(ssm_elems));
        }
        return;
    }
    auto bufs = std::make_unique<BackendBuffers>((size_t) (2 * n_layer));
    std::vector<ggml_tensor *> conv, ssm;
    for (int64_t l = 0; l < n_layer; ++l) {
        ggml_context * c = bufs->ctx(on[(size_t) l]);
        conv.push_back(ggml_new_tensor_2d(c, GGML_TYPE_F32, conv_elems, n_lanes_));
        ssm.push_back(ggml_new_tensor_2d(c, GGML_TYPE_F32, ssm_elems, n_lanes_));
        ggml_format_name(conv.back(), "arena_conv_%d", (int) l);
        ggml_format_name(ssm.back(), "arena_ssm_%d", (int) l);
    }
    bufs->allocate("the recurrent state of " + std::to_string(n_lanes_) + " sessions");   // throws: nothing is kept
    recurrent_bufs_ = std::move(bufs);
    conv_ = std::move(conv);
    ssm_ = std::move(ssm);
    recurrent_backends_ = on;
}

ggml_tensor * PoolArena::conv_lanes(ggml_context * ctx, int64_t l, int64_t lane, int64_t n) const {
    return lane_columns(ctx, conv_[l], lane, n);
}

ggml_tensor * PoolArena::ssm_lanes(ggml_context * ctx, int64_t l, int64_t lane, int64_t n) const {
    return lane_columns(ctx, ssm_[l], lane, n);
}

ggml_tensor * PoolArena::lane_conv(ggml_context * ctx, int64_t l, int64_t lane) const { return bind(conv_lanes(ctx, l, lane, 1)); }
ggml_tensor * PoolArena::lane_ssm(ggml_context * ctx, int64_t l, int64_t lane) const { return bind(ssm_lanes(ctx, l, lane, 1)); }

ggml_tensor * PoolArena::lane_k(ggml_context * ctx, int64_t il, int64_t lane) const {
    ggml_tensor * k = k_[il];
    return bind(ggml_view_2d(ctx, k, k->ne[0], layout_.pool_tokens, k->nb[1], (size_t) (lane * layout_.pool_tokens) * k->nb[1]));
}

ggml_tensor * PoolArena::lane_v(ggml_context * ctx, int64_t il, int64_t lane) const {
    ggml_tensor * v = v_[il];
    if (layout_.v_trans) {   // lane l: channels [l * n_embd_v, (l + 1) * n_embd_v) of pool_tokens values each
        return bind(ggml_view_2d(ctx, v, layout_.pool_tokens, layout_.n_embd_v, v->nb[1], (size_t) (lane * layout_.n_embd_v) * v->nb[1]));
    }
    return bind(ggml_view_2d(ctx, v, v->ne[0], layout_.pool_tokens, v->nb[1], (size_t) (lane * layout_.pool_tokens) * v->nb[1]));
}

}  // namespace kvf
