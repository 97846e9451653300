#include "kv/recurrent_state.h"

#include "common/byte_io.h"
#include "kv/pool_arena.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace kvf {

RecurrentState::RecurrentState(const LayerBackends & backends, int64_t n_layer, int64_t conv_elems, int64_t ssm_elems,
                               int64_t carry_elems, ggml_backend_t carry_backend)
    : bufs_((size_t) (2 * n_layer + 1)), conv_elems_(conv_elems), ssm_elems_(ssm_elems), carry_elems_(carry_elems) {
    check_sizes(n_layer, conv_elems, ssm_elems, carry_elems);
    const LayerBackends on = per_layer(backends, n_layer);
    for (int64_t l = 0; l < n_layer; ++l) {
        ggml_context * c = bufs_.ctx(on[(size_t) l]);
        conv_.push_back(ggml_new_tensor_1d(c, GGML_TYPE_F32, conv_elems));
        ssm_.push_back(ggml_new_tensor_1d(c, GGML_TYPE_F32, ssm_elems));
        ggml_format_name(conv_.back(), "conv_state.%d", (int) l);
        ggml_format_name(ssm_.back(), "ssm_state.%d", (int) l);
        backend_of_.insert(backend_of_.end(), 2, on[(size_t) l]);
    }
    make_carry(on, carry_elems, carry_backend);
    bufs_.allocate("the recurrent state (" + std::to_string(n_layer) + " layers of " +
                   std::to_string((conv_elems + ssm_elems) * 4) + " bytes)");
    clear();
}

RecurrentState::RecurrentState(const LayerBackends & backends, int64_t n_layer, int64_t conv_elems, int64_t ssm_elems,
                               int64_t carry_elems, ggml_backend_t carry_backend, std::shared_ptr<PoolArena> arena,
                               int64_t lane)
    : bufs_(1), arena_(std::move(arena)), lane_(lane), conv_elems_(conv_elems), ssm_elems_(ssm_elems),
      carry_elems_(carry_elems) {
    check_sizes(n_layer, conv_elems, ssm_elems, carry_elems);
    if (!arena_ || lane < 0 || lane >= arena_->n_lanes()) throw std::invalid_argument("RecurrentState: no arena lane given");
    const LayerBackends on = per_layer(backends, n_layer);
    arena_->reserve_recurrent(on, n_layer, conv_elems, ssm_elems);
    view_ctx_.reset(ggml_init({ggml_tensor_overhead() * (size_t) (2 * n_layer), nullptr, true}));
    for (int64_t l = 0; l < n_layer; ++l) {
        conv_.push_back(arena_->lane_conv(view_ctx_.get(), l, lane));
        ssm_.push_back(arena_->lane_ssm(view_ctx_.get(), l, lane));
        backend_of_.insert(backend_of_.end(), 2, on[(size_t) l]);
    }
    make_carry(on, carry_elems, carry_backend);
    bufs_.allocate("the multi-token-prediction head's carry");
    clear();   // a lane an earlier session held keeps its bytes
}

void RecurrentState::check_sizes(int64_t n_layer, int64_t conv_elems, int64_t ssm_elems, int64_t carry_elems) {
    if (n_layer <= 0 || conv_elems <= 0 || ssm_elems <= 0 || carry_elems < 0) {
        throw std::invalid_argument("RecurrentState needs positive layer count and state sizes");
    }
}

void RecurrentState::make_carry(const LayerBackends & on, int64_t carry_elems, ggml_backend_t carry_backend) {
    if (carry_elems <= 0) return;
    if (!carry_backend) carry_backend = on.back();
    carry_ = ggml_new_tensor_1d(bufs_.ctx(carry_backend), GGML_TYPE_F32, carry_elems);
    ggml_set_name(carry_, "mtp_carry");
    backend_of_.push_back(carry_backend);
}

RecurrentState::~RecurrentState() = default;

int64_t RecurrentState::lane_bytes_on(ggml_backend_t backend) const {
    if (!arena_) return 0;
    int64_t n = 0;
    for (size_t l = 0; l < conv_.size(); ++l) {
        if (!backend || backend_of_[2 * l] == backend) n += (int64_t) (ggml_nbytes(conv_[l]) + ggml_nbytes(ssm_[l]));
    }
    return n;
}

int64_t RecurrentState::device_bytes() const {
    return lane_bytes_on(nullptr) + bufs_.bytes() + (stash_bufs_ ? stash_bufs_->bytes() : 0);
}

int64_t RecurrentState::device_bytes_on(ggml_backend_t backend) const {
    return lane_bytes_on(backend) + bufs_.bytes_on(backend) + (stash_bufs_ ? stash_bufs_->bytes_on(backend) : 0);
}

std::vector<ggml_tensor *> RecurrentState::tensors() const {
    std::vector<ggml_tensor *> out;
    for (int64_t l = 0; l < n_layer(); ++l) {
        out.push_back(conv_[(size_t) l]);
        out.push_back(ssm_[(size_t) l]);
    }
    if (carry_) out.push_back(carry_);
    return out;
}

void RecurrentState::stash() {
    const std::vector<ggml_tensor *> live = tensors();
    if (!stash_bufs_) {
        auto bufs = std::make_unique<BackendBuffers>(live.size());
        std::vector<ggml_tensor *> twins;
        for (size_t i = 0; i < live.size(); ++i) twins.push_back(ggml_dup_tensor(bufs->ctx(backend_of_[i]), live[i]));
        bufs->allocate("a second copy of the recurrent state");   // throws: nothing is kept
        stash_bufs_ = std::move(bufs);
        stash_ = std::move(twins);
    }
    for (size_t i = 0; i < live.size(); ++i) ggml_backend_tensor_copy(live[i], stash_[i]);
    stash_n_ = n_tokens_;
}

size_t RecurrentState::total_bytes() const {
    return (size_t) (n_layer() * (conv_elems_ + ssm_elems_) + carry_elems_) * sizeof(float);
}

void RecurrentState::place_step(int64_t start, int64_t n) {
    if (start != n_tokens_ || n < 0) {
        throw std::logic_error("recurrent state: positions [" + std::to_string(start) + ", " + std::to_string(start + n) +
                               ") placed after " + std::to_string(n_tokens_) + " consumed");
    }
    n_tokens_ += n;
}

void RecurrentState::unplace_step(int64_t start) {
    if (start < 0 || start > n_tokens_) {
        throw std::logic_error("recurrent state: cannot unplace from " + std::to_string(start) + " with " +
                               std::to_string(n_tokens_) + " consumed");
    }
    n_tokens_ = start;
}

bool RecurrentState::can_truncate(int64_t n) const {
    if (n == n_tokens_ || n == 0 || n == stash_n_) return true;
    for (const Copy & c : checkpoints_) if (c.n_tokens == n) return true;
    return false;
}

void RecurrentState::truncate(int64_t n) {
    if (!can_truncate(n)) {
        throw std::invalid_argument("the recurrent state of the linear-attention layers cannot go back to position " +
                                    std::to_string(n) + " of " + std::to_string(n_tokens_) +
                                    " (only to 0, or to a checkpoint: rewind_point)");
    }
    if (n == n_tokens_) return;
    if (n == 0) {
        clear();
        return;
    }
    while (!checkpoints_.empty() && checkpoints_.back().n_tokens > n) checkpoints_.pop_back();
    if (n == stash_n_) {
        const std::vector<ggml_tensor *> live = tensors();
        for (size_t i = 0; i < live.size(); ++i) ggml_backend_tensor_copy(stash_[i], live[i]);
        n_tokens_ = n;
        return;
    }
    load(checkpoints_.back());   // the one at n: sorted, and it exists
    if (stash_n_ > n) stash_n_ = -1;
}

void RecurrentState::clear() {
    bufs_.clear();
    if (arena_) for (size_t l = 0; l < conv_.size(); ++l) {
        for (ggml_tensor * t : {conv_[l], ssm_[l]}) ggml_backend_tensor_memset(t, 0, 0, ggml_nbytes(t));
    }
    n_tokens_ = 0;
    checkpoints_.clear();
    stash_n_ = -1;
}

void RecurrentState::checkpoint() { add_checkpoint(copy()); }

RecurrentState::Copy RecurrentState::blank(int64_t n) const {
    Copy c;
    c.n_tokens = n;
    c.bytes.resize(total_bytes());
    return c;
}

void RecurrentState::copy_part_into(int64_t l, Copy & c) const {
    if (l < 0 || l > n_layer() || (l == n_layer() && !carry_) || c.bytes.size() != total_bytes()) {
        throw std::logic_error("recurrent state: no part " + std::to_string(l) + " to copy");
    }
    uint8_t * p = c.bytes.data() + (size_t) l * (size_t) (conv_elems_ + ssm_elems_) * sizeof(float);   // copy()'s order
    const auto get = [&p](const ggml_tensor * t) {
        ggml_backend_tensor_get(t, p, 0, ggml_nbytes(t));
        p += ggml_nbytes(t);
    };
    if (l == n_layer()) {
        get(carry_);
        return;
    }
    get(conv_[(size_t) l]);
    get(ssm_[(size_t) l]);
}

void RecurrentState::add_checkpoint(Copy c) {
    if (c.n_tokens > n_tokens_ || c.bytes.size() != total_bytes()) {
        throw std::logic_error("recurrent state: a checkpoint at " + std::to_string(c.n_tokens) + " of " +
                               std::to_string(n_tokens_) + " consumed, or of another size");
    }
    while (!checkpoints_.empty() && checkpoints_.back().n_tokens >= c.n_tokens) checkpoints_.pop_back();
    checkpoints_.push_back(std::move(c));
    if (checkpoints_.size() > k_max_checkpoints) checkpoints_.erase(checkpoints_.begin());
}

int64_t RecurrentState::rewind_point(int64_t n) const {
    if (n >= n_tokens_) return n_tokens_;
    int64_t best = stash_n_ <= n ? std::max<int64_t>(stash_n_, 0) : 0;
    for (const Copy & c : checkpoints_) if (c.n_tokens <= n) best = std::max(best, c.n_tokens);
    return best;
}

int64_t RecurrentState::checkpoint_bytes() const {
    int64_t n = 0;
    for (const Copy & c : checkpoints_) n += (int64_t) c.bytes.size();
    return n;
}

RecurrentState::Copy RecurrentState::copy() const {
    Copy c;
    c.n_tokens = n_tokens_;
    c.bytes.resize(total_bytes());
    uint8_t * p = c.bytes.data();
    for (const ggml_tensor * t : tensors()) {
        ggml_backend_tensor_get(t, p, 0, ggml_nbytes(t));
        p += ggml_nbytes(t);
    }
    return c;
}

void RecurrentState::restore(const Copy & c) {
    load(c);
    checkpoints_.clear();
    stash_n_ = -1;
}

namespace {

struct StateSavePoint : ContextMemory::SavePoint {
    RecurrentState::Copy copy;
};

}  // namespace

std::unique_ptr<ContextMemory::SavePoint> RecurrentState::save_point() const {
    auto p = std::make_unique<StateSavePoint>();
    p->copy = copy();
    return p;
}

void RecurrentState::roll_back(const SavePoint & p) { rewind_to(dynamic_cast<const StateSavePoint &>(p).copy); }

void RecurrentState::rewind_to(const Copy & c) {
    while (!checkpoints_.empty() && checkpoints_.back().n_tokens > c.n_tokens) checkpoints_.pop_back();
    if (stash_n_ > c.n_tokens) stash_n_ = -1;
    load(c);
}

void RecurrentState::load(const Copy & c) {
    if (c.bytes.size() != total_bytes()) throw std::logic_error("recurrent state: a copy of another size");
    const uint8_t * p = c.bytes.data();
    for (ggml_tensor * t : tensors()) {
        ggml_backend_tensor_set(t, p, 0, ggml_nbytes(t));
        p += ggml_nbytes(t);
    }
    n_tokens_ = c.n_tokens;
}

void RecurrentState::save_state(ByteWriter & w, int64_t n_tokens) const {
    if (n_tokens != n_tokens_) {
        throw SnapshotError("cannot save the linear-attention layers' state at " + std::to_string(n_tokens) + " of " +
                            std::to_string(n_tokens_) + " tokens: a recurrent state exists only for everything consumed "
                            "(save the whole session)");
    }
    w.put<int64_t>(n_layer());
    w.put<int64_t>(conv_elems_);
    w.put<int64_t>(ssm_elems_);
    w.put<int64_t>(carry_elems_);
    w.put<int64_t>(n_tokens_);
    const Copy c = copy();
    w.raw(c.bytes.data(), c.bytes.size());
}

RecurrentState::Copy RecurrentState::state_from(ByteReader & r, uint32_t version, int64_t n_tokens) const {
    if (version != 1 && version != k_state_version) {   // version 1: no carry (before the MTP head)
        r.fail("version " + std::to_string(version) + " is not supported (this build reads 1 and " +
               std::to_string(k_state_version) + ")");
    }
    const int64_t L = r.get<int64_t>("n_layer"), conv = r.get<int64_t>("conv_elems"), ssm = r.get<int64_t>("ssm_elems");
    const int64_t carry = version >= 2 ? r.get<int64_t>("carry_elems") : 0;
    if (carry != carry_elems_) {
        r.fail(carry_elems_ > 0 ? "saved by a session without the multi-token-prediction head; this one drafts with it"
                                : "saved by a session with the multi-token-prediction head; this one has none");
    }
    if (L != n_layer() || conv != conv_elems_ || ssm != ssm_elems_) {
        r.fail("saved for " + std::to_string(L) + " layers of " + std::to_string(conv) + " + " + std::to_string(ssm) +
               " state values, this model has " + std::to_string(n_layer()) + " of " + std::to_string(conv_elems_) + " + " +
               std::to_string(ssm_elems_));
    }
    Copy c;
    c.n_tokens = r.get<int64_t>("n_tokens");
    if (c.n_tokens != n_tokens) {
        r.fail("the state holds " + std::to_string(c.n_tokens) + " tokens, the session " + std::to_string(n_tokens));
    }
    const uint8_t * p = r.take(total_bytes(), "state bytes");
    c.bytes.assign(p, p + total_bytes());
    return c;
}

}  // namespace kvf
