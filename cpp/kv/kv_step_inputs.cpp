#include "kv/kv_step_inputs.h"

#include "ggml-backend.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

namespace kvf {

namespace {

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

}  // namespace

KvKeyOrder kv_key_order(const KvPager & pager, const KvLayout & layout, bool ordered, int64_t kv_pad) {
    KvKeyOrder o;
    const std::vector<int64_t> slot_pos = pager.slot_positions();
    const int64_t n_slots = (int64_t) slot_pos.size();
    o.gathered = ordered && !pager.is_identity() && !ggml_is_quantized(layout.type_k) &&
                 !ggml_is_quantized(layout.type_v);
    if (!o.gathered) {
        int64_t last = -1;
        for (int64_t s = n_slots - 1; s >= 0 && last < 0; --s) if (slot_pos[s] >= 0) last = s;
        o.n_kv = std::min(round_up(last + 1, kv_pad), n_slots);
        o.key_pos = slot_pos;
        return o;
    }
    // Occupied slots sorted by position first, then the empty ones: O(pool log pool), never O(context).
    std::vector<int64_t> slots(n_slots);
    for (int64_t s = 0; s < n_slots; ++s) slots[s] = s;
    std::stable_sort(slots.begin(), slots.end(), [&](int64_t a, int64_t b) {
        const int64_t pa = slot_pos[a] < 0 ? INT64_MAX : slot_pos[a], pb = slot_pos[b] < 0 ? INT64_MAX : slot_pos[b];
        return pa < pb;
    });
    o.slot_row.resize(n_slots);
    o.key_pos.resize(n_slots);
    int64_t n_occupied = 0;
    for (int64_t j = 0; j < n_slots; ++j) {
        o.slot_row[slots[j]] = j;
        o.key_pos[j] = slot_pos[slots[j]];
        n_occupied += o.key_pos[j] >= 0;
    }
    o.n_kv = std::min(round_up(n_occupied, kv_pad), n_slots);
    return o;
}

KvStepInputs kv_step_inputs_new(ggml_context * ctx, const KvLayout & L, int64_t n_tokens, int64_t n_kv, bool gathered,
                                const CausalBand * band, int64_t first_pos) {
    if (gathered && L.v_trans) {
        throw std::logic_error("a position-ordered copy gathers slot rows: it needs V in slot rows, not v_trans");
    }
    KvStepInputs in;
    in.slots = band ? band->counts_i64(ctx, first_pos, n_tokens) : ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n_tokens);
    in.v_slots = L.v_trans ? ggml_new_tensor_1d(ctx, GGML_TYPE_I64, L.n_embd_v * n_tokens) : nullptr;
    in.band = band;
    in.first_pos = first_pos;
    in.mask = band ? nullptr : ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_kv, n_tokens);
    in.kv_order = gathered ? ggml_new_tensor_1d(ctx, GGML_TYPE_I64, L.pool_tokens) : nullptr;
    for (ggml_tensor * t : {band ? nullptr : in.slots, in.v_slots, in.mask, in.kv_order}) {
        if (t) ggml_set_input(t);
    }
    return in;
}

KvMaskRows kv_mask_rows(ggml_context * ctx, const KvStepInputs & in, int64_t n_kv, int64_t row0, int64_t n_rows) {
    if (in.band) {
        const int64_t first = in.first_pos + row0, seen = in.band->keys_seen(first + n_rows - 1, n_kv);
        return {in.band->mask(ctx, seen, n_rows, first), seen};
    }
    if (row0 == 0 && n_rows == in.mask->ne[1]) return {in.mask, n_kv};
    return {ggml_view_2d(ctx, in.mask, in.mask->ne[0], n_rows, in.mask->nb[1], row0 * in.mask->nb[1]), n_kv};
}

ggml_tensor * kv_mask_exact(ggml_context * ctx, const KvMaskRows & mr) {
    if (mr.mask->ne[0] == mr.n_kv) return mr.mask;
    return ggml_cont(ctx, ggml_view_2d(ctx, mr.mask, mr.n_kv, mr.mask->ne[1], mr.mask->nb[1], 0));
}

CausalBand::CausalBand(ggml_backend_t backend, int64_t n_slots, int64_t max_rows, int64_t kv_pad, int64_t max_group)
    // Sequences of a group start a block's rows apart in a row of the table: on 16-byte columns only if that is 8 halves.
    : n_slots_(n_slots), max_rows_(max_rows), kv_pad_(kv_pad), max_group_(max_rows % 8 ? 1 : std::max<int64_t>(max_group, 1)) {
    // The table's geometry (header): a row offset rho < 8 keeps each view's first column a multiple of 8 halves, as
    // flash attention's 16-byte loads of a mask row want; the last view's keys reach past n_slots by kv_pad (and a
    // group's earliest block reads (max_group - 1) x max_rows columns past its latest block's).
    edge_ = round_up(std::max<int64_t>(n_slots, 1), 8);
    width_ = round_up(edge_ + max_group_ * max_rows + kv_pad + 8, 8);
    const int64_t rows = max_rows + 8;
    ggml_init_params ip{5 * ggml_tensor_overhead(), nullptr, true};
    ctx_ = ggml_init(ip);
    table_ = ggml_new_tensor_2d(ctx_, GGML_TYPE_F16, width_, rows);
    counts_i32_ = ggml_new_tensor_1d(ctx_, GGML_TYPE_I32, std::max<int64_t>(n_slots, 1));
    counts_i64_ = ggml_new_tensor_1d(ctx_, GGML_TYPE_I64, std::max<int64_t>(n_slots, 1));
    if (max_group_ > 1) block_order_ = ggml_new_tensor_1d(ctx_, GGML_TYPE_I32, max_group_ * max_rows);
    buf_ = ggml_backend_alloc_ctx_tensors(ctx_, backend);
    if (!buf_) {
        ggml_free(ctx_);
        throw std::runtime_error("could not allocate " + std::to_string(n_slots * 12 + width_ * rows * 2) +
                                 " bytes for the prefill's causal mask and step indices");
    }
    std::vector<int32_t> c32((size_t) counts_i32_->ne[0]);
    std::vector<int64_t> c64(c32.size());
    for (size_t i = 0; i < c32.size(); ++i) c32[i] = (int32_t) i, c64[i] = (int64_t) i;
    ggml_backend_tensor_set(counts_i32_, c32.data(), 0, ggml_nbytes(counts_i32_));
    ggml_backend_tensor_set(counts_i64_, c64.data(), 0, ggml_nbytes(counts_i64_));
    if (block_order_) {   // entry s * max_rows + i: row i of block max_group - 1 - s
        std::vector<int32_t> order((size_t) (max_group_ * max_rows));
        for (int64_t j = 0; j < (int64_t) order.size(); ++j) {
            order[(size_t) j] = (int32_t) ((max_group_ - 1 - j / max_rows) * max_rows + j % max_rows);
        }
        ggml_backend_tensor_set(block_order_, order.data(), 0, ggml_nbytes(block_order_));
    }
    // Row r: 0 up to column edge + r, -inf after. Set a row at a time: the table is about one attention block.
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), masked = ggml_fp32_to_fp16(-INFINITY);
    std::vector<ggml_fp16_t> row((size_t) width_);
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t seen = std::min(width_, edge_ + r + 1);
        std::fill(row.begin(), row.begin() + seen, zero);
        std::fill(row.begin() + seen, row.end(), masked);
        ggml_backend_tensor_set(table_, row.data(), (size_t) (r * table_->nb[1]), row.size() * sizeof(ggml_fp16_t));
    }
}

CausalBand::~CausalBand() {
    ggml_backend_buffer_free(buf_);
    ggml_free(ctx_);
}

ggml_tensor * CausalBand::mask(ggml_context * ctx, int64_t n_kv, int64_t n_rows, int64_t first_pos) const {
    // Query i at first_pos + i sees key k iff k - i <= first_pos; table row r sees column c iff c - r <= edge. So
    // query i is row rho + i from column col: c - r = k - i + col - rho, and col = edge + rho - first_pos.
    const int64_t rho = first_pos % 8, col = edge_ + rho - first_pos;
    if (first_pos < 0 || first_pos >= std::max<int64_t>(n_slots_, 1) || n_rows < 1 || n_rows > max_rows_ ||
        n_kv < first_pos + n_rows || col + n_kv > width_) {
        throw std::logic_error("CausalBand: a block of queries outside the band");
    }
    // A contiguous view, rows of the table's whole width: flash attention reads the first n_kv columns of each
    // row (ggml refuses a mask view with a row stride other than its width, though every kernel honours it).
    return ggml_view_2d(ctx, table_, width_, n_rows, table_->nb[1], (size_t) (rho * table_->nb[1] + col * table_->nb[0]));
}

ggml_tensor * CausalBand::group_mask(ggml_context * ctx, int64_t n_kv, int64_t n_rows, int64_t first_pos,
                                     int64_t n_blocks) const {
    // Block b (0 = the earliest) starts at first_pos + b n_rows, so its view starts (b' - b) n_rows columns before
    // that of an earlier block b' (mask()), on the same rows (n_rows keeps first_pos % 8): with the latest block as
    // sequence 0, sequence s is the latest block's view moved s n_rows columns on.
    const int64_t latest = first_pos + (n_blocks - 1) * n_rows;
    const int64_t col = edge_ + latest % 8 - latest;
    if (n_blocks < 1 || n_blocks > max_group_ || n_rows % 8 != 0 ||
        col + (n_blocks - 1) * n_rows + n_kv > width_) {
        throw std::logic_error("CausalBand: a group of query blocks outside the band");
    }
    return mask(ctx, n_kv, n_rows, latest);
}

void CausalBand::as_sequences(ggml_tensor * mask, int64_t n_rows, int64_t n_blocks) {
    // Set after the view was made (ggml sizes a view as if it were contiguous: these sequences overlap).
    mask->ne[3] = n_blocks;
    mask->nb[3] = (size_t) n_rows * sizeof(ggml_fp16_t);
}

ggml_tensor * CausalBand::block_order(ggml_context * ctx, int64_t n_blocks) const {
    if (!block_order_ || n_blocks < 1 || n_blocks > max_group_) throw std::logic_error("CausalBand: no such block order");
    // Its last n_blocks blocks' entries are the order of n_blocks blocks (block max_group - 1 - s there is
    // n_blocks - 1 - s counted from the first of them).
    const int64_t n = n_blocks * max_rows_;
    return ggml_view_1d(ctx, block_order_, n, (size_t) (block_order_->ne[0] - n) * sizeof(int32_t));
}

int64_t CausalBand::keys_seen(int64_t last_pos, int64_t n_kv) const {
    return std::min(n_kv, (last_pos + 1 + kv_pad_ - 1) / kv_pad_ * kv_pad_);
}

namespace {

ggml_tensor * counts_view(ggml_context * ctx, ggml_tensor * counts, int64_t first, int64_t n) {
    if (first < 0 || n < 1 || first + n > counts->ne[0]) throw std::logic_error("CausalBand: counts outside the band");
    return ggml_view_1d(ctx, counts, n, first * counts->nb[0]);
}

}  // namespace

ggml_tensor * CausalBand::counts_i32(ggml_context * ctx, int64_t first, int64_t n) const {
    return counts_view(ctx, counts_i32_, first, n);
}

ggml_tensor * CausalBand::counts_i64(ggml_context * ctx, int64_t first, int64_t n) const {
    return counts_view(ctx, counts_i64_, first, n);
}

int64_t CausalBand::device_bytes() const { return (int64_t) ggml_backend_buffer_get_size(buf_); }

void kv_step_inputs_set(const KvStepInputs & in, const KvLayout & L, const KvKeyOrder & order, const Plan & alloc,
                        const int32_t * pos, std::vector<uint8_t> & scratch) {
    const int64_t n = alloc.span_n;
    const bool same_shape = (!in.slots || in.slots->ne[0] == n) && (in.band || (in.mask->ne[0] == order.n_kv && in.mask->ne[1] == n)) &&
                            (in.kv_order != nullptr) == order.gathered;
    if (!same_shape) {
        throw std::logic_error("kv_step_inputs_set: the step's input tensors were made for another shape");
    }
    if (in.slots) {   // none: a step that only reads (alloc then has no slots either)
        std::vector<int64_t> slots(n);
        for (int64_t i = 0; i < n; ++i) slots[i] = alloc.slots[i];
        if (!in.band) {
            ggml_backend_tensor_set(in.slots, slots.data(), 0, n * sizeof(int64_t));
        } else {
            for (int64_t i = 0; i < n; ++i) {
                if (slots[i] != in.first_pos + i) throw std::logic_error("kv_step_inputs_set: a band's pool is not filled in order");
            }
        }
        if (in.v_slots) {   // value c of token i lands at element c * pool_tokens + slot (V is [pool_tokens, n_embd_v])
            const int64_t W = L.n_embd_v, P = L.pool_tokens;
            std::vector<int64_t> v_slots((size_t) (W * n));
            for (int64_t i = 0; i < n; ++i) {
                for (int64_t c = 0; c < W; ++c) v_slots[i * W + c] = c * P + slots[i];
            }
            ggml_backend_tensor_set(in.v_slots, v_slots.data(), 0, v_slots.size() * sizeof(int64_t));
        }
    }

    if (in.kv_order) ggml_backend_tensor_set(in.kv_order, order.slot_row.data(), 0, order.slot_row.size() * sizeof(int64_t));
    if (in.band) return;
    const int64_t n_kv = order.n_kv;
    scratch.resize((size_t) n_kv * n * sizeof(ggml_fp16_t));
    auto * mask = reinterpret_cast<ggml_fp16_t *>(scratch.data());
    build_slot_mask(order.key_pos.data(), n_kv, pos, n, order.window, mask);
    ggml_backend_tensor_set(in.mask, mask, 0, scratch.size());
}

void kv_step_inputs_set_lanes(const KvStepInputs & in, const KvLayout & L, const std::vector<LaneToken> & tokens,
                              std::vector<uint8_t> & scratch) {
    const int64_t n = (int64_t) tokens.size(), n_kv = in.mask->ne[0], P = L.pool_tokens, W = L.n_embd_v;
    if (in.slots->ne[0] != n || in.mask->ne[1] != n || in.kv_order) {
        throw std::logic_error("kv_step_inputs_set_lanes: the step's input tensors were made for another shape");
    }
    std::vector<int64_t> rows(n);
    for (int64_t t = 0; t < n; ++t) rows[t] = tokens[t].lane * P + tokens[t].slot;
    ggml_backend_tensor_set(in.slots, rows.data(), 0, n * sizeof(int64_t));
    if (in.v_slots) {
        std::vector<int64_t> v_slots((size_t) (W * n));
        for (int64_t t = 0; t < n; ++t) {
            for (int64_t c = 0; c < W; ++c) v_slots[t * W + c] = tokens[t].lane * P * W + c * P + tokens[t].slot;
        }
        ggml_backend_tensor_set(in.v_slots, v_slots.data(), 0, v_slots.size() * sizeof(int64_t));
    }
    scratch.resize((size_t) (n_kv * n) * sizeof(ggml_fp16_t));
    auto * mask = reinterpret_cast<ggml_fp16_t *>(scratch.data());
    for (int64_t t = 0; t < n; ++t) {
        const KvKeyOrder & o = *tokens[t].order;
        if (o.gathered || (int64_t) o.key_pos.size() < n_kv) {
            throw std::logic_error("kv_step_inputs_set_lanes: a lane's keys are not its pool's slots");
        }
        build_slot_mask(o.key_pos.data(), n_kv, &tokens[t].pos, 1, o.window, mask + t * n_kv);
    }
    ggml_backend_tensor_set(in.mask, mask, 0, scratch.size());
}

void build_slot_mask(const int64_t * slot_pos, int64_t n_kv, const int32_t * pos, int64_t n_tokens, int64_t window,
                     ggml_fp16_t * out) {
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f);
    const ggml_fp16_t ninf = ggml_fp32_to_fp16(-INFINITY);
    auto full_row = [&](int64_t i) {
        const int64_t p = pos[i];
        ggml_fp16_t * row = out + i * n_kv;
        for (int64_t s = 0; s < n_kv; ++s) {
            const int64_t q = slot_pos[s];
            const bool visible = q >= 0 && q <= p && (window <= 0 || p - q < window);
            row[s] = visible ? zero : ninf;
        }
    };
    full_row(0);
    if (n_tokens == 1) return;   // a decode step: nothing to derive
    const bool ascending = window <= 0 && std::is_sorted(pos, pos + n_tokens);
    if (!ascending) {
        for (int64_t i = 1; i < n_tokens; ++i) full_row(i);
        return;
    }
    // A prefill step's positions ascend: row i is row i-1 plus the slots holding positions in
    // (pos[i-1], pos[i]]. Copying rows instead of testing every slot made the mask of a 512-token step over
    // 32K keys ~10x cheaper; it was a quarter of a full-cache prefill's wall time on the H100.
    std::vector<std::pair<int64_t, int64_t>> later;   // (position, slot) of the keys row 0 does not see yet
    for (int64_t s = 0; s < n_kv; ++s) {
        if (slot_pos[s] > pos[0]) later.emplace_back(slot_pos[s], s);
    }
    std::sort(later.begin(), later.end());
    size_t next = 0;
    for (int64_t i = 1; i < n_tokens; ++i) {
        ggml_fp16_t * row = out + i * n_kv;
        std::memcpy(row, row - n_kv, (size_t) n_kv * sizeof(ggml_fp16_t));
        for (; next < later.size() && later[next].first <= pos[i]; ++next) row[later[next].second] = zero;
    }
}

}  // namespace kvf
