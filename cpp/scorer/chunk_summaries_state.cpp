// ChunkSummaries state for snapshots (see chunk_summaries.h).
//
// Layout, version 1: n_layer, n_head_kv, head_dim, n_chunks (i64); has (u8 x n_chunks); then mean, min
// and max (f32 x n_chunks x n_layer x n_head_kv x head_dim each), in the in-memory order.
#include "scorer/chunk_summaries.h"
#include "common/byte_io.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace kvf {

void ChunkSummaries::save_state(ByteWriter & w, int64_t n_chunks) const {
    const int64_t n = std::min(n_chunks, this->n_chunks());
    for (int64_t v : {shape_.n_layer, shape_.n_head_kv, shape_.head_dim, n}) w.put<int64_t>(v);
    w.raw(has_.data(), (size_t) n);
    for (const ChunkRows * a : {&mean_, &min_, &max_}) {
        for (int64_t c = 0; c < n; ++c) w.raw(a->at(c), (size_t) shape_.per_chunk() * sizeof(float));
    }
}

ChunkSummaries ChunkSummaries::state_from(ByteReader & r, uint32_t version, int64_t n_sealed) const {
    if (version != k_state_version) {
        r.fail("version " + std::to_string(version) + " is not supported (this build reads " +
               std::to_string(k_state_version) + ")");
    }
    const char * names[] = {"n_layer", "n_head_kv", "head_dim"};
    const int64_t ours[] = {shape_.n_layer, shape_.n_head_kv, shape_.head_dim};
    for (int i = 0; i < 3; ++i) {
        const int64_t v = r.get<int64_t>(names[i]);
        if (v != ours[i]) {
            r.fail(std::string("saved with ") + names[i] + "=" + std::to_string(v) + " but this model has " +
                   std::to_string(ours[i]));
        }
    }
    // one flag and three summaries per chunk, for at most the chunks that hold positions (the sealed ones
    // and a partial head chunk)
    const int64_t n = r.count("summaries", 1 + 3 * sizeof(float) * (size_t) shape_.per_chunk(), 0, n_sealed + 1);
    ChunkSummaries out(shape_);
    const uint8_t * has = r.take((size_t) n, "has");
    out.has_.assign(has, has + n);
    for (int64_t c = 0; c < n; ++c) {
        if (out.has_[c] > 1) r.fail("chunk " + std::to_string(c) + " has flag " + std::to_string(out.has_[c]));
        if (out.has_[c] && c >= n_sealed) {
            r.fail("chunk " + std::to_string(c) + " has a summary but only " + std::to_string(n_sealed) +
                   " chunks are whole");
        }
    }
    const size_t row_bytes = (size_t) shape_.per_chunk() * sizeof(float);
    for (ChunkRows * a : {&out.mean_, &out.min_, &out.max_}) {
        a->grow_to(n);
        // copied bytewise: the values need not be aligned in the file
        for (int64_t c = 0; c < n; ++c) std::memcpy(a->at(c), r.take(row_bytes, "summary values"), row_bytes);
    }
    return out;
}

}  // namespace kvf
