#include "kv/pooled_kv.h"

#include "kv/pool_arena.h"


#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

namespace kvf {

ggml_type kv_type_from_name(const std::string & name) {
    if (name == "f16")  return GGML_TYPE_F16;
    if (name == "q8_0") return GGML_TYPE_Q8_0;
    if (name == "q4_0") return GGML_TYPE_Q4_0;
    if (name == "f32")  return GGML_TYPE_F32;
    if (name == "bf16") return GGML_TYPE_BF16;
    throw std::invalid_argument("unknown kv_type '" + name + "' (expected f16, q8_0, q4_0, bf16 or f32)");
}

namespace {

constexpr size_t k_max_slab_bytes = 256u << 20;   // host store grows in slabs up to this size (pinning is slow)

// Elements of N bytes, src [rows][cols] -> dst [cols][rows]. Element by memcpy: images inside a snapshot's
// bytes sit at any offset, so a typed load could be misaligned (UBSan caught one in a v_trans restore).
template <size_t N> void transpose(const uint8_t * src, uint8_t * dst, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) std::memcpy(dst + (c * rows + r) * N, src + (r * cols + c) * N, N);
    }
}

// Copy an image, turning each layer's V between channel runs ([n_embd_v][C] values, v_trans) and slot
// rows ([C][n_embd_v]); K and non-transposed layouts are copied as they are.
void transpose_v_images(const KvLayout & L, const uint8_t * src, uint8_t * dst, bool to_rows) {
    const int64_t C = L.chunk_tokens, W = L.n_embd_v;
    const size_t k_bytes = ggml_row_size(L.type_k, L.n_embd_k) * C, v_bytes = ggml_row_size(L.type_v, W) * C;
    const int64_t rows = to_rows ? W : C, cols = to_rows ? C : W;
    for (int64_t il = 0; il < L.n_layer; ++il, src += k_bytes + v_bytes, dst += k_bytes + v_bytes) {
        if (!L.v_trans) {
            std::memcpy(dst, src, k_bytes + v_bytes);
            continue;
        }
        std::memcpy(dst, src, k_bytes);
        if (ggml_type_size(L.type_v) == 2) {   // f16, bf16
            transpose<2>(src + k_bytes, dst + k_bytes, rows, cols);
        } else {                                // f32 (v_trans is refused for quantized types)
            transpose<4>(src + k_bytes, dst + k_bytes, rows, cols);
        }
    }
}

}  // namespace

void PooledKV::check_layout(const KvLayout & L) {
    if (L.n_layer <= 0 || L.n_embd_k <= 0 || L.n_embd_v <= 0) {
        throw std::invalid_argument("PooledKV: n_layer, n_embd_k and n_embd_v must be positive");
    }
    if (L.chunk_tokens <= 0 || L.pool_tokens <= 0 || L.pool_tokens % L.chunk_tokens != 0) {
        throw std::invalid_argument("PooledKV: pool_tokens=" + std::to_string(L.pool_tokens) +
                                    " must be a positive multiple of chunk_tokens=" + std::to_string(L.chunk_tokens));
    }
    if (L.v_trans && ggml_is_quantized(L.type_v)) {
        throw std::invalid_argument(std::string("PooledKV: a transposed V needs an unquantized type, not ") +
                                    ggml_type_name(L.type_v));
    }
    for (auto [t, w, what] : {std::tuple{L.type_k, L.n_embd_k, "K"}, std::tuple{L.type_v, L.n_embd_v, "V"}}) {
        if (w % ggml_blck_size(t) != 0) {
            throw std::invalid_argument(std::string("PooledKV: ") + what + " row width " + std::to_string(w) +
                                        " is not a multiple of the " + ggml_type_name(t) + " block size");
        }
    }
}

namespace {

bool any_can_pin(const std::vector<ggml_backend_t> & backends) {
    return std::any_of(backends.begin(), backends.end(), [](ggml_backend_t b) { return can_pin_for(b); });
}

}  // namespace

PooledKV::PooledKV(const LayerBackends & backends, const KvLayout & layout) : layout_(layout) {
    const auto & L = layout_;
    check_layout(L);
    backends_ = per_layer(backends, L.n_layer);
    distinct_ = distinct(backends_);
    own_ = std::make_unique<BackendBuffers>((size_t) (2 * L.n_layer));
    for (int64_t il = 0; il < L.n_layer; ++il) {
        ggml_context * c = own_->ctx(backends_[il]);
        k_.push_back(ggml_new_tensor_2d(c, L.type_k, L.n_embd_k, L.pool_tokens));
        v_.push_back(L.v_trans ? ggml_new_tensor_2d(c, L.type_v, L.pool_tokens, L.n_embd_v)
                               : ggml_new_tensor_2d(c, L.type_v, L.n_embd_v, L.pool_tokens));
        ggml_format_name(k_.back(), "pool_k_%d", (int) il);
        ggml_format_name(v_.back(), "pool_v_%d", (int) il);
    }
    own_->allocate("the KV pool");   // zeroed: empty slots are masked, but -inf * garbage could poison a sum
    can_pin_ = any_can_pin(distinct_);
}

PooledKV::PooledKV(const LayerBackends & backends, const KvLayout & layout, std::shared_ptr<PoolArena> arena)
    : layout_(layout), arena_(std::move(arena)) {
    const auto & L = layout_;
    check_layout(L);
    if (!arena_) throw std::invalid_argument("PooledKV: no pool arena given");
    backends_ = per_layer(backends, L.n_layer);
    distinct_ = distinct(backends_);
    lane_ = arena_->acquire(backends_, L);
    ggml_init_params params = {ggml_tensor_overhead() * (size_t) (2 * L.n_layer + 1), nullptr, true};
    ctx_ = ggml_init(params);
    for (int64_t il = 0; il < L.n_layer; ++il) {
        k_.push_back(arena_->lane_k(ctx_, il, lane_));
        v_.push_back(arena_->lane_v(ctx_, il, lane_));
        // A lane an earlier session held keeps its bytes: start from zeros, as a pool of its own does.
        for (ggml_tensor * t : {k_.back(), v_.back()}) ggml_backend_tensor_memset(t, 0, 0, ggml_nbytes(t));
    }
    can_pin_ = any_can_pin(distinct_);
}

PooledKV::~PooledKV() {
    synchronize();   // no copy may still be writing into a slab or reading a block that goes away
    slabs_.clear();
    own_.reset();
    if (ctx_) ggml_free(ctx_);
    if (arena_) arena_->release(lane_);
}

int64_t PooledKV::chunk_bytes() const {
    const auto & L = layout_;
    return L.n_layer * L.chunk_tokens * (int64_t) (ggml_row_size(L.type_k, L.n_embd_k) + ggml_row_size(L.type_v, L.n_embd_v));
}

int64_t PooledKV::device_bytes() const { return chunk_bytes() * (layout_.pool_tokens / layout_.chunk_tokens); }

int64_t PooledKV::device_bytes_on(ggml_backend_t backend) const {
    const int64_t n = std::count(backends_.begin(), backends_.end(), backend);
    return device_bytes() / layout_.n_layer * n;   // every layer's share is the same
}

int64_t PooledKV::host_bytes() const { return (int64_t) host_.size() * chunk_bytes(); }

int64_t PooledKV::host_store_bytes() const {
    int64_t n = 0;
    for (const auto & slab : slabs_) n += (int64_t) slab->size();
    return n;
}

void PooledKV::synchronize() const {
    for (ggml_backend_t b : distinct_) ggml_backend_synchronize(b);
}

uint8_t * PooledKV::image_for(int64_t chunk) {
    auto it = host_.find(chunk);
    if (it != host_.end()) return it->second;
    if (free_slots_.empty()) {
        // Grow geometrically (4, 8, 16, ... slots) up to k_max_slab_bytes, so tiny models pin little.
        const size_t slot = (size_t) chunk_bytes();
        const size_t n_slots = std::max<size_t>(1, std::min(k_max_slab_bytes / slot, (size_t) 4 << slabs_.size()));
        add_slab(std::make_unique<HostMemory>(n_slots * slot, can_pin_));
    }
    uint8_t * p = free_slots_.back();
    free_slots_.pop_back();
    host_.emplace(chunk, p);
    return p;
}

void PooledKV::add_slab(std::unique_ptr<HostMemory> slab) {
    if (can_pin_ && !slab->pinned()) can_pin_ = false;   // out of lockable memory: carry on pageable
    pinned_ = pinned_ || slab->pinned();
    const size_t slot = (size_t) chunk_bytes(), n_slots = slab->size() / slot;
    uint8_t * base = slab->data();
    slabs_.push_back(std::move(slab));
    for (size_t i = n_slots; i-- > 0;) free_slots_.push_back(base + i * slot);
}

int64_t PooledKV::host_slots_short(int64_t n_images) const {
    return std::max<int64_t>(0, n_images - (int64_t) host_.size() - (int64_t) free_slots_.size());
}

std::vector<std::unique_ptr<HostMemory>> PooledKV::make_slabs(int64_t n_slots) const {
    const size_t slot = (size_t) chunk_bytes(), per_slab = std::max<size_t>(1, k_max_slab_bytes / slot);
    std::vector<std::unique_ptr<HostMemory>> slabs;
    // One after another: slabs registered from several threads at once blocked the prefill's kernel launches in the
    // driver (32K on an H100: 3.2 s in cudaHostRegister instead of 0.2 s, 1.2 s of GPU idle instead of 0.35; R94).
    for (int64_t left = n_slots; left > 0; left -= (int64_t) per_slab) {
        slabs.push_back(std::make_unique<HostMemory>(std::min((size_t) left, per_slab) * slot, can_pin_));
    }
    return slabs;
}

void PooledKV::add_slabs(std::vector<std::unique_ptr<HostMemory>> slabs) {
    for (auto & slab : slabs) add_slab(std::move(slab));
}

void PooledKV::release_image(int64_t chunk) {
    // No wait needed: a later copy into this slot is queued behind any copy still using it.
    auto it = host_.find(chunk);
    if (it == host_.end()) return;
    free_slots_.push_back(it->second);
    host_.erase(it);
}

template <typename Fn> void PooledKV::for_each_region(int64_t block, Fn && fn, int64_t only_layer) const {
    if (block < 0 || block >= layout_.pool_tokens / layout_.chunk_tokens) {
        throw std::out_of_range("PooledKV: block " + std::to_string(block) + " outside the pool");
    }
    if (only_layer >= layout_.n_layer) {
        throw std::out_of_range("PooledKV: layer " + std::to_string(only_layer) + " outside the pool");
    }
    const int64_t C = layout_.chunk_tokens;
    size_t image_off = 0;
    for (int64_t il = 0; il < layout_.n_layer; ++il) {
        if (only_layer >= 0 && il != only_layer) continue;
        for (ggml_tensor * t : {k_[il], v_[il]}) {
            // A transposed V chunk is one run of C values per channel: one 2D copy, not one copy per
            // channel (per-channel copies cost ~6000 synchronous transfers a chunk on a GPU).
            const bool runs = t == v_[il] && layout_.v_trans;
            const size_t size = runs ? ggml_type_size(t->type) * C : t->nb[1] * C;
            const size_t n = runs ? (size_t) t->ne[1] : 1;
            fn(il, t, (size_t) block * size, size, n, runs ? t->nb[1] : size, image_off);
            image_off += n * size;
        }
    }
}

void PooledKV::image_to_rows(const uint8_t * native, uint8_t * rows) const {
    transpose_v_images(layout_, native, rows, true);
}

void PooledKV::image_from_rows(const uint8_t * rows, uint8_t * native) const {
    transpose_v_images(layout_, rows, native, false);
}

void PooledKV::execute(const Plan & plan, int64_t uncomputed_from) {
    // Queued on the backend's stream (plain copies on the CPU backend); see the header.
    for (const ChunkMove & m : plan.page_outs) {
        if (m.chunk >= uncomputed_from) {
            image_for(m.chunk);
            continue;
        }
        if (!m.copy) {
            if (!host_.count(m.chunk)) {
                throw std::logic_error("PooledKV: page-out without copy of chunk " + std::to_string(m.chunk) +
                                       " that has no host image");
            }
            continue;
        }
        uint8_t * image = image_for(m.chunk);
        for_each_region(m.block, [&](int64_t il, ggml_tensor * t, size_t off, size_t size, size_t n, size_t stride, size_t img_off) {
            ggml_backend_tensor_get_2d_async(backends_[il], t, image + img_off, off, size, n, stride, size);
        });
    }
    for (const ChunkMove & m : plan.page_ins) {
        auto it = host_.find(m.chunk);
        if (it == host_.end()) {
            throw std::logic_error("PooledKV: page-in of chunk " + std::to_string(m.chunk) + " with no host image");
        }
        for_each_region(m.block, [&](int64_t il, ggml_tensor * t, size_t off, size_t size, size_t n, size_t stride, size_t img_off) {
            ggml_backend_tensor_set_2d_async(backends_[il], t, it->second + img_off, off, size, n, stride, size);
        });
    }
    for (int64_t c : plan.dropped) release_image(c);
    // A chunk being (re)written invalidates its image; the pager forgets it too (copy=true next time).
    for (const ChunkMove & m : plan.fresh) release_image(m.chunk);
}

void PooledKV::get_layer_async(int64_t block, int64_t il, uint8_t * out, ggml_backend_t stream) const {
    if (il < 0) throw std::out_of_range("PooledKV: layer " + std::to_string(il) + " outside the pool");
    for_each_region(block, [&](int64_t, ggml_tensor * t, size_t off, size_t size, size_t n, size_t stride, size_t img_off) {
        ggml_backend_tensor_get_2d_async(stream ? stream : backends_[il], t, out + img_off, off, size, n, stride, size);
    }, il);
}

void PooledKV::set_layer_async(int64_t block, int64_t il, const uint8_t * in, ggml_backend_t stream) {
    if (il < 0) throw std::out_of_range("PooledKV: layer " + std::to_string(il) + " outside the pool");
    for_each_region(block, [&](int64_t, ggml_tensor * t, size_t off, size_t size, size_t n, size_t stride, size_t img_off) {
        ggml_backend_tensor_set_2d_async(stream ? stream : backends_[il], t, in + img_off, off, size, n, stride, size);
    }, il);
}

void PooledKV::get_k_rows_async(int64_t block, int64_t il, uint8_t * out) const {
    if (il < 0 || il >= layout_.n_layer) throw std::out_of_range("PooledKV: layer " + std::to_string(il) + " outside the pool");
    ggml_tensor * k = k_[il];
    const size_t rows = (size_t) layout_.chunk_tokens;
    ggml_backend_tensor_get_async(backends_[il], k, out, (size_t) block * rows * k->nb[1], rows * k->nb[1]);
}

uint8_t * PooledKV::image_layer(int64_t chunk, int64_t il) {
    if (il < 0 || il >= layout_.n_layer) throw std::out_of_range("PooledKV: layer " + std::to_string(il) + " outside the pool");
    return image_for(chunk) + il * layer_chunk_bytes();   // every layer's part of an image has the same size
}

void PooledKV::get_block(int64_t block, uint8_t * out) const {
    for_each_region(block, [&](int64_t, ggml_tensor * t, size_t off, size_t size, size_t n, size_t stride, size_t img_off) {
        ggml_backend_tensor_get_2d(t, out + img_off, off, size, n, stride, size);
    });
}

void PooledKV::set_block(int64_t block, const uint8_t * in) {
    for_each_region(block, [&](int64_t, ggml_tensor * t, size_t off, size_t size, size_t n, size_t stride, size_t img_off) {
        ggml_backend_tensor_set_2d(t, in + img_off, off, size, n, stride, size);
    });
}

std::vector<uint8_t> PooledKV::read_block(int64_t block) const {
    synchronize();
    std::vector<uint8_t> out((size_t) chunk_bytes());
    get_block(block, out.data());
    return out;
}

void PooledKV::write_block(int64_t block, const std::vector<uint8_t> & bytes) {
    if ((int64_t) bytes.size() != chunk_bytes()) {
        throw std::invalid_argument("PooledKV: block image has " + std::to_string(bytes.size()) + " bytes, expected " +
                                    std::to_string(chunk_bytes()));
    }
    synchronize();
    set_block(block, bytes.data());
}

std::vector<uint8_t> PooledKV::host_image(int64_t chunk) const {
    auto it = host_.find(chunk);
    if (it == host_.end()) throw std::out_of_range("PooledKV: no host image for chunk " + std::to_string(chunk));
    synchronize();
    return std::vector<uint8_t>(it->second, it->second + chunk_bytes());
}

std::vector<uint8_t> PooledKV::chunk_rows(int64_t chunk, int64_t block) const {
    const std::vector<uint8_t> native = block >= 0 ? read_block(block) : host_image(chunk);
    std::vector<uint8_t> rows(native.size());
    image_to_rows(native.data(), rows.data());
    return rows;
}

void PooledKV::write_block_rows(int64_t block, const std::vector<uint8_t> & rows) {
    if ((int64_t) rows.size() != chunk_bytes()) {
        throw std::invalid_argument("PooledKV: chunk rows have " + std::to_string(rows.size()) + " bytes, expected " +
                                    std::to_string(chunk_bytes()));
    }
    std::vector<uint8_t> native(rows.size());
    image_from_rows(rows.data(), native.data());
    write_block(block, native);
}

void PooledKV::clear_host() {
    synchronize();
    for (auto & [c, p] : host_) free_slots_.push_back(p);
    host_.clear();
}

}  // namespace kvf
