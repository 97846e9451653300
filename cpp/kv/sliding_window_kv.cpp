#include "kv/sliding_window_kv.h"

#include "common/byte_io.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>

namespace kvf {

namespace {

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

}  // namespace

SlidingWindowKV::SlidingWindowKV(const LayerBackends & backends, const KvLayout & layout, int64_t window, int64_t kv_pad)
    : window_(window), kv_pad_(kv_pad) {
    if (window <= 0 || layout.pool_tokens <= window || layout.pool_tokens % layout.chunk_tokens != 0) {
        throw std::invalid_argument("a sliding-window ring of " + std::to_string(layout.pool_tokens) +
                                    " rows cannot hold a window of " + std::to_string(window) + " and a step");
    }
    kv_ = std::make_unique<PooledKV>(backends, layout);
    slot_pos_.assign((size_t) layout.pool_tokens, -1);
}

int64_t SlidingWindowKV::ring_tokens_for(int64_t window, int64_t max_step, int64_t kv_pad, int64_t chunk_tokens) {
    return round_up(round_up(window + max_step, kv_pad), chunk_tokens);
}

Plan SlidingWindowKV::place(int64_t start, int64_t n) {
    if (start != n_tokens_ || n <= 0 || n > max_step()) {
        throw std::logic_error("SlidingWindowKV::place: a step of " + std::to_string(n) + " tokens at " +
                               std::to_string(start) + " (ring holds " + std::to_string(n_tokens_) + ", steps up to " +
                               std::to_string(max_step()) + ")");
    }
    Plan p;
    p.span_start = start;
    p.span_n = n;
    p.slots.resize((size_t) n);
    const int64_t R = ring_tokens();
    for (int64_t i = 0; i < n; ++i) {
        const int64_t row = (start + i) % R;
        p.slots[(size_t) i] = (int32_t) row;
        slot_pos_[(size_t) row] = start + i;
    }
    n_tokens_ = start + n;
    p.n_tokens_after = n_tokens_;
    return p;
}

void SlidingWindowKV::place_step(int64_t start, int64_t n) {
    Mark before = mark();
    step_plan_ = place(start, n);
    step_mark_ = std::move(before);
    step_order_ = key_order();
}

void SlidingWindowKV::unplace_step(int64_t start) {
    if (start != step_mark_.n_tokens) {
        throw std::logic_error("SlidingWindowKV::unplace_step: the step placed last starts at " +
                               std::to_string(step_mark_.n_tokens) + ", not " + std::to_string(start));
    }
    rewind_to(step_mark_);
}

KvKeyOrder SlidingWindowKV::key_order() const {
    KvKeyOrder o;
    const int64_t R = ring_tokens();
    // Before the ring wraps, row p holds position p: attend only the rows written so far (padded).
    o.n_kv = n_tokens_ >= R ? R : std::min(R, std::max(kv_pad_, round_up(n_tokens_, kv_pad_)));
    o.key_pos = slot_pos_;
    o.window = window_;
    return o;
}

bool SlidingWindowKV::can_truncate(int64_t n) const {
    if (n < 0 || n > n_tokens_) return false;
    // The oldest position a query at n may see must not have been overwritten (nothing to keep at 0).
    return n == 0 || std::max<int64_t>(0, n - window_) >= n_tokens_ - ring_tokens();
}

void SlidingWindowKV::truncate(int64_t n) {
    if (!can_truncate(n)) {
        throw std::invalid_argument("cannot rewind the sliding-window layers to " + std::to_string(n) + " tokens: their ring (" +
                                    std::to_string(ring_tokens()) + " rows) no longer holds the window before it (holds up to " +
                                    std::to_string(n_tokens_) + "); start over from an empty session");
    }
    for (int64_t & p : slot_pos_) if (p >= n) p = -1;
    n_tokens_ = n;
}

int64_t SlidingWindowKV::rewind_point(int64_t n) const {
    n = std::clamp<int64_t>(n, 0, n_tokens_);
    return can_truncate(n) ? n : 0;
}

namespace {

struct RingSavePoint : ContextMemory::SavePoint {
    SlidingWindowKV::Mark mark;
    std::vector<uint8_t> rows;   // empty: the ring held nothing
};

}  // namespace

std::unique_ptr<ContextMemory::SavePoint> SlidingWindowKV::save_point() const {
    auto p = std::make_unique<RingSavePoint>();
    p->mark = mark();
    if (n_tokens_ > 0) p->rows = copy_rows();
    return p;
}

void SlidingWindowKV::roll_back(const SavePoint & p) {
    const auto & saved = dynamic_cast<const RingSavePoint &>(p);
    rewind_to(saved.mark);
    if (!saved.rows.empty()) restore_rows(saved.rows);
}

void SlidingWindowKV::clear() {
    std::fill(slot_pos_.begin(), slot_pos_.end(), -1);
    n_tokens_ = 0;
}

void SlidingWindowKV::save_state(ByteWriter & w, int64_t n_tokens) const {
    if (!can_truncate(n_tokens)) {
        throw SnapshotError("cannot save the sliding-window layers at " + std::to_string(n_tokens) + " of " +
                            std::to_string(n_tokens_) + " tokens: their ring no longer holds the window before it");
    }
    w.put<int64_t>(window_);
    w.put<int64_t>(ring_tokens());
    w.put<int64_t>(n_tokens);
    std::vector<int64_t> pos = slot_pos_;
    for (int64_t & p : pos) if (p >= n_tokens) p = -1;
    w.array(pos);
    kv_->save_state(w, all_blocks());
}

std::vector<uint8_t> SlidingWindowKV::copy_rows() const {
    std::vector<uint8_t> rows;
    for (int64_t b : all_blocks()) {
        const std::vector<uint8_t> block = kv_->read_block(b);
        rows.insert(rows.end(), block.begin(), block.end());
    }
    return rows;
}

void SlidingWindowKV::restore_rows(const std::vector<uint8_t> & rows) {
    const size_t n = (size_t) kv_->chunk_bytes();
    const std::vector<int64_t> blocks = all_blocks();
    if (rows.size() != n * blocks.size()) throw std::logic_error("SlidingWindowKV::restore_rows: bytes of another ring");
    for (size_t i = 0; i < blocks.size(); ++i) kv_->write_block(blocks[i], std::vector<uint8_t>(rows.begin() + i * n, rows.begin() + (i + 1) * n));
}

std::vector<int64_t> SlidingWindowKV::all_blocks() const {
    std::vector<int64_t> blocks((size_t) (ring_tokens() / kv_->layout().chunk_tokens));
    std::iota(blocks.begin(), blocks.end(), 0);
    return blocks;
}

SlidingWindowKV::Saved SlidingWindowKV::state_from(ByteReader & r, uint32_t version, int64_t n_tokens) const {
    if (version != k_state_version) {
        r.fail("version " + std::to_string(version) + " is not supported (this build reads " + std::to_string(k_state_version) + ")");
    }
    const int64_t window = r.get<int64_t>("window"), R = r.get<int64_t>("ring_tokens");
    if (window != window_) r.fail("saved with a window of " + std::to_string(window) + ", the model has " + std::to_string(window_));
    if (R != ring_tokens()) {
        r.fail("saved with a ring of " + std::to_string(R) + " rows but this session has " + std::to_string(ring_tokens()) +
               " (the ring is window + n_batch: restore with the saved n_batch)");
    }
    Saved s;
    s.n_tokens = r.get<int64_t>("n_tokens");
    if (s.n_tokens != n_tokens) {
        r.fail("the ring holds " + std::to_string(s.n_tokens) + " tokens, the session " + std::to_string(n_tokens));
    }
    s.slot_pos = r.array<int64_t>("slot_pos", R);
    if ((int64_t) s.slot_pos.size() != R) r.fail("slot_pos has " + std::to_string(s.slot_pos.size()) + " entries");
    for (int64_t row = 0; row < R; ++row) {   // the invariant: row p % R holds p, and only held positions
        const int64_t p = s.slot_pos[(size_t) row];
        if (p != -1 && (p < 0 || p >= n_tokens || p % R != row || p < n_tokens - R)) {
            r.fail("ring row " + std::to_string(row) + " claims position " + std::to_string(p));
        }
    }
    s.blocks = kv_->state_from(r, PooledKV::k_state_version, R / kv_->layout().chunk_tokens);
    return s;
}

void SlidingWindowKV::load_state(const Saved & s) {
    kv_->load_state(s.blocks, all_blocks(), std::vector<uint8_t>(s.blocks.size(), 0));
    slot_pos_ = s.slot_pos;
    n_tokens_ = s.n_tokens;
}

}  // namespace kvf
