// PooledKV state for snapshots (see pooled_kv.h).
//
// Layout, version 1: n_layer, n_embd_k, n_embd_v, chunk_tokens (i64), type_k, type_v (i32, ggml type ids),
// chunk_bytes, n_chunks (i64), then n_chunks images of chunk_bytes each. An image is what read_block
// returns (per layer, the chunk's K rows then its V rows), with V always in slot rows: a pool with a
// transposed V (v_trans) converts, so snapshots move between attention paths (e.g. CPU matmul -> GPU flash).
#include "kv/pooled_kv.h"
#include "common/byte_io.h"

#include <cstring>
#include <string>

namespace kvf {

namespace {

constexpr int64_t k_header_bytes = 4 * 8 + 2 * 4 + 2 * 8;

std::string type_name(int32_t t) {
    return t >= 0 && t < GGML_TYPE_COUNT ? ggml_type_name((ggml_type) t) : "type " + std::to_string(t);
}

}  // namespace

int64_t PooledKV::state_bytes(int64_t n_chunks) const { return k_header_bytes + n_chunks * chunk_bytes(); }

void PooledKV::save_state(ByteWriter & w, const std::vector<int64_t> & chunk_blocks) const {
    const auto & L = layout_;
    for (int64_t v : {L.n_layer, L.n_embd_k, L.n_embd_v, L.chunk_tokens}) w.put<int64_t>(v);
    w.put<int32_t>((int32_t) L.type_k);
    w.put<int32_t>((int32_t) L.type_v);
    w.put<int64_t>(chunk_bytes());
    w.put<int64_t>((int64_t) chunk_blocks.size());
    synchronize();   // queued page-outs/page-ins (GPU) must have landed before blocks and images are read
    std::vector<uint8_t> native((size_t) chunk_bytes()), rows(native.size());
    for (size_t c = 0; c < chunk_blocks.size(); ++c) {
        if (chunk_blocks[c] < 0) {
            native = host_image((int64_t) c);   // throws out_of_range if it has none
        } else {
            get_block(chunk_blocks[c], native.data());
        }
        image_to_rows(native.data(), rows.data());
        w.raw(rows.data(), rows.size());
    }
}

std::vector<const uint8_t *> PooledKV::state_from(ByteReader & r, uint32_t version, int64_t n_chunks) const {
    if (version != k_state_version) {
        r.fail("version " + std::to_string(version) + " is not supported (this build reads " +
               std::to_string(k_state_version) + ")");
    }
    const auto & L = layout_;
    const char * names[] = {"n_layer", "n_embd_k", "n_embd_v", "chunk_tokens"};
    const int64_t ours[] = {L.n_layer, L.n_embd_k, L.n_embd_v, L.chunk_tokens};
    for (int i = 0; i < 4; ++i) {
        const int64_t v = r.get<int64_t>(names[i]);
        if (v != ours[i]) {
            r.fail(std::string("saved with ") + names[i] + "=" + std::to_string(v) + " but this session has " +
                   std::to_string(ours[i]));
        }
    }
    const int32_t type_k = r.get<int32_t>("type_k");
    const int32_t type_v = r.get<int32_t>("type_v");
    if (type_k != (int32_t) L.type_k || type_v != (int32_t) L.type_v) {
        r.fail("saved with KV types " + type_name(type_k) + "/" + type_name(type_v) + " but this session uses " +
               type_name(L.type_k) + "/" + type_name(L.type_v) + " (kv_type must match)");
    }
    const int64_t n_bytes = r.get<int64_t>("chunk_bytes");
    if (n_bytes != chunk_bytes()) {
        r.fail("chunk_bytes=" + std::to_string(n_bytes) + " but this layout has " + std::to_string(chunk_bytes()));
    }
    r.count("images", (size_t) n_bytes, n_chunks, n_chunks);
    std::vector<const uint8_t *> images((size_t) n_chunks);
    for (auto & p : images) p = r.take((size_t) n_bytes, "chunk image");
    return images;
}

void PooledKV::load_state(const std::vector<const uint8_t *> & images, const std::vector<int64_t> & chunk_blocks,
                          const std::vector<uint8_t> & host_valid) {
    std::vector<uint8_t> native((size_t) chunk_bytes());
    clear_host();   // also waits for queued copies, so none lands on a block or image written here
    for (size_t c = 0; c < images.size(); ++c) {
        image_from_rows(images[c], native.data());
        if (chunk_blocks[c] >= 0) set_block(chunk_blocks[c], native.data());
        if (host_valid[c]) std::memcpy(image_for((int64_t) c), native.data(), native.size());
    }
}

}  // namespace kvf
