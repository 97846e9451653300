// ChunkSummaries: per sealed chunk, per (pooled layer, KV head), what the qk and quest scorers need:
// the L2-normalised mean of the chunk's post-RoPE keys, and the channel-wise min and max of the keys.
// A chunk is sealed once all its positions are written; it is summarised then, from the pool, while it
// is certainly resident. Summaries live on the host and survive page-outs.
//
// Scores (higher = more relevant), for the queries of the current step (post-RoPE, per layer):
//   qk:    mean over layers and query tokens of max over query heads of cos(q, mean key of its KV head)
//   quest: per layer, mean over query tokens of max over query heads of sum_i max(q_i*min_i, q_i*max_i)
//          (Quest's upper bound on q.k over the chunk), z-scored over chunks, then the max over layers
// Chunks without a summary get NaN, which the pager ranks below every real score.
#pragma once

#include "common/host_memory.h"
#include "kv/pooled_kv.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kvf {

class ByteReader;
class ByteWriter;

struct SummaryShape {
    int64_t n_layer = 0;
    int64_t n_head_kv = 0;
    int64_t head_dim = 0;
    int64_t per_chunk() const { return n_layer * n_head_kv * head_dim; }
};

// Queries of one step: [n_layer][n_tokens][n_head][head_dim], float.
struct StepQueries {
    int64_t n_layer = 0, n_tokens = 0, n_head = 0, head_dim = 0;
    std::vector<float> data;
    const float * at(int64_t il, int64_t t, int64_t h) const {
        return data.data() + ((il * n_tokens + t) * n_head + h) * head_dim;
    }
};

// Rows of `width` floats, one per chunk, that grow without moving: a server's round waits for a seal, and a
// contiguous vector's growth copied the whole table (~75 ms at 16K tokens of the 8B shape's width on a CPU core,
// once after every prompt; seconds at 1M). Blocks of k_block rows, each row zeroed when it is added (a block
// zeroed when made faulted in 24 MB at once: ~20 ms a seal every 64 chunks).
class ChunkRows {
public:
    explicit ChunkRows(int64_t width) : width_(width) {}
    void grow_to(int64_t n_rows);
    float * at(int64_t row) { return blocks_[(size_t) (row / k_block)].get() + (row % k_block) * width_; }
    const float * at(int64_t row) const { return blocks_[(size_t) (row / k_block)].get() + (row % k_block) * width_; }
    void clear() { blocks_.clear(); n_rows_ = 0; }

private:
    static constexpr int64_t k_block = 64;
    int64_t width_, n_rows_ = 0;
    std::vector<std::unique_ptr<float[]>> blocks_;
};

class ChunkSummaries {
public:
    explicit ChunkSummaries(const SummaryShape & shape)
        : shape_(shape), mean_(shape.per_chunk()), min_(shape.per_chunk()), max_(shape.per_chunk()) {}

    const SummaryShape & shape() const { return shape_; }
    int64_t n_chunks() const { return (int64_t) has_.size(); }
    bool has(int64_t chunk) const { return chunk < n_chunks() && has_[chunk]; }

    // Summarise `chunk` from the K rows of `block` in the pool (all pooled layers): every layer's rows are queued
    // into one staging buffer (page-locked where the pool's host store is) and waited for once. Read layer by
    // layer, each a synchronous copy, a seal took ~21 ms on the H200 (8B shape), stalling a server's whole round.
    void seal(int64_t chunk, int64_t block, const PooledKV & kv);
    // The same for one layer, from that layer's K rows of the chunk (layout L's type and width): layer-major
    // prefill seals layer by layer; the chunk counts as summarised once its last layer is sealed.
    void seal_layer(int64_t chunk, int64_t il, const KvLayout & L, const uint8_t * k_rows);
    void forget_from(int64_t chunk);   // truncate: chunks >= chunk lose their summary
    void clear() { has_.clear(); mean_.clear(); min_.clear(); max_.clear(); }

    std::vector<float> scores(const std::string & kind, const StepQueries & q, int64_t n_chunks) const;
    std::vector<float> mean_keys() const;   // [chunk][layer][head_kv][head_dim], a copy

    // ---- state (chunk_summaries_state.cpp), for snapshots: qk/quest stay warm after a restore ----
    static constexpr uint32_t k_state_version = 1;
    void save_state(ByteWriter & w, int64_t n_chunks) const;   // chunks [0, n_chunks) (fewer if never sealed)
    // Summaries of this shape as saved; a summarised chunk must be one of the first n_sealed (whole) chunks.
    ChunkSummaries state_from(ByteReader & r, uint32_t version, int64_t n_sealed) const;

private:
    SummaryShape shape_;
    std::vector<uint8_t> has_;
    ChunkRows mean_, min_, max_;   // per chunk: [layer][head_kv][head_dim]
    std::unique_ptr<HostMemory> staging_;   // seal's K rows of every layer (made on first use)
};

}  // namespace kvf
