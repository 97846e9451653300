#include "scorer/chunk_summaries.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace kvf {

void ChunkRows::grow_to(int64_t n_rows) {
    while ((int64_t) blocks_.size() * k_block < n_rows) {
        blocks_.push_back(std::unique_ptr<float[]>(new float[(size_t) (k_block * width_)]));   // untouched pages
    }
    for (; n_rows_ < n_rows; ++n_rows_) std::fill_n(at(n_rows_), width_, 0.0f);
}

void ChunkSummaries::seal(int64_t chunk, int64_t block, const PooledKV & kv) {
    const KvLayout & L = kv.layout();
    // The pool may hold the MTP head's K/V after the trunk's layers (the last one): never summarised, as the scorers
    // score with the trunk's queries.
    if (L.n_layer < shape_.n_layer) throw std::logic_error("ChunkSummaries: shape does not match the pool");
    const size_t layer_bytes = kv.k(0)->nb[1] * (size_t) L.chunk_tokens;   // every pooled layer's K rows: one width
    const size_t need = layer_bytes * (size_t) shape_.n_layer;
    if (!staging_ || staging_->size() < need) staging_ = std::make_unique<HostMemory>(need, kv.pinned_host());
    for (int64_t il = 0; il < shape_.n_layer; ++il) kv.get_k_rows_async(block, il, staging_->data() + il * layer_bytes);
    kv.synchronize();
    for (int64_t il = 0; il < shape_.n_layer; ++il) seal_layer(chunk, il, L, staging_->data() + il * layer_bytes);
}

void ChunkSummaries::seal_layer(int64_t chunk, int64_t il, const KvLayout & L, const uint8_t * k_rows) {
    const SummaryShape & s = shape_;
    if (L.n_embd_k != s.n_head_kv * s.head_dim || il < 0 || il >= s.n_layer) {
        throw std::logic_error("ChunkSummaries: shape does not match the pool");
    }
    if (chunk >= n_chunks()) {
        has_.resize(chunk + 1, 0);
        for (ChunkRows * rows : {&mean_, &min_, &max_}) rows->grow_to(chunk + 1);
    }
    const int64_t n_rows = L.chunk_tokens, width = L.n_embd_k;
    std::vector<float> rows((size_t) (n_rows * width));
    if (L.type_k == GGML_TYPE_F32) {
        std::copy_n(reinterpret_cast<const float *>(k_rows), rows.size(), rows.data());
    } else {
        ggml_get_type_traits(L.type_k)->to_float(k_rows, rows.data(), n_rows * width);   // contiguous rows: one call
    }
    for (int64_t h = 0; h < s.n_head_kv; ++h) {
        const size_t off = (size_t) ((il * s.n_head_kv + h) * s.head_dim);
        float * mean = mean_.at(chunk) + off, * mn = min_.at(chunk) + off, * mx = max_.at(chunk) + off;
        std::fill_n(mean, s.head_dim, 0.0f);
        std::fill_n(mn, s.head_dim, std::numeric_limits<float>::infinity());
        std::fill_n(mx, s.head_dim, -std::numeric_limits<float>::infinity());
        for (int64_t r = 0; r < n_rows; ++r) {
            const float * x = &rows[(size_t) (r * width + h * s.head_dim)];
            for (int64_t i = 0; i < s.head_dim; ++i) {
                mean[i] += x[i];
                mn[i] = std::min(mn[i], x[i]);
                mx[i] = std::max(mx[i], x[i]);
            }
        }
        double norm = 0.0;
        for (int64_t i = 0; i < s.head_dim; ++i) norm += (double) mean[i] * mean[i];
        const float inv = norm > 0.0 ? (float) (1.0 / std::sqrt(norm)) : 0.0f;
        for (int64_t i = 0; i < s.head_dim; ++i) mean[i] *= inv;
    }
    if (il == s.n_layer - 1) has_[chunk] = 1;   // layers are sealed in order; the last completes the chunk
}

// Per layer: (score - mean) / std over the chunks that have a summary.
static void z_normalise_layers(std::vector<std::vector<double>> & per_layer, const ChunkSummaries & cs) {
    for (auto & row : per_layer) {
        double sum = 0.0, sq = 0.0;
        int64_t n = 0;
        for (int64_t c = 0; c < (int64_t) row.size(); ++c) {
            if (!cs.has(c)) continue;
            sum += row[c];
            sq += row[c] * row[c];
            ++n;
        }
        if (n == 0) continue;
        const double mean = sum / n, sd = std::sqrt(std::max(sq / n - mean * mean, 0.0)) + 1e-9;
        for (double & v : row) v = (v - mean) / sd;
    }
}

std::vector<float> ChunkSummaries::mean_keys() const {
    std::vector<float> out((size_t) (n_chunks() * shape_.per_chunk()));
    for (int64_t c = 0; c < n_chunks(); ++c) std::copy_n(mean_.at(c), shape_.per_chunk(), out.begin() + c * shape_.per_chunk());
    return out;
}

void ChunkSummaries::forget_from(int64_t chunk) {
    if (chunk < n_chunks()) std::fill(has_.begin() + chunk, has_.end(), 0);
}

std::vector<float> ChunkSummaries::scores(const std::string & kind, const StepQueries & q, int64_t n_chunks) const {
    const SummaryShape & s = shape_;
    const bool quest = kind == "quest";
    if (!quest && kind != "qk") throw std::invalid_argument("unknown scorer '" + kind + "' (expected qk or quest)");
    if (q.n_tokens == 0) throw std::runtime_error("no captured queries yet: run a forward step first");
    if (q.n_layer != s.n_layer || q.head_dim != s.head_dim || q.n_head % s.n_head_kv != 0) {
        throw std::logic_error("ChunkSummaries: captured queries do not match the summaries");
    }
    const int64_t group = q.n_head / s.n_head_kv;
    // qk compares directions: normalise each query once.
    std::vector<float> qn(q.data);
    if (!quest) {
        for (size_t v = 0; v < qn.size(); v += (size_t) s.head_dim) {
            double norm = 0.0;
            for (int64_t i = 0; i < s.head_dim; ++i) norm += (double) qn[v + i] * qn[v + i];
            const float inv = norm > 0.0 ? (float) (1.0 / std::sqrt(norm)) : 0.0f;
            for (int64_t i = 0; i < s.head_dim; ++i) qn[v + i] *= inv;
        }
    }
    // per_layer[il][c]: the layer's score of chunk c, mean over query tokens of max over query heads
    std::vector<std::vector<double>> per_layer(s.n_layer, std::vector<double>((size_t) n_chunks, 0.0));
    for (int64_t c = 0; c < n_chunks; ++c) {
        if (!has(c)) continue;
        for (int64_t il = 0; il < s.n_layer; ++il) {
            double total = 0.0;
            for (int64_t t = 0; t < q.n_tokens; ++t) {
                float best = -std::numeric_limits<float>::infinity();
                for (int64_t h = 0; h < q.n_head; ++h) {
                    const size_t off = (size_t) ((il * s.n_head_kv + h / group) * s.head_dim);
                    const float * qv = qn.data() + ((il * q.n_tokens + t) * q.n_head + h) * s.head_dim;
                    float acc = 0.0f;
                    if (quest) {
                        const float * mn = min_.at(c) + off, * mx = max_.at(c) + off;
                        for (int64_t i = 0; i < s.head_dim; ++i) acc += std::max(qv[i] * mn[i], qv[i] * mx[i]);
                    } else {
                        const float * mean = mean_.at(c) + off;
                        for (int64_t i = 0; i < s.head_dim; ++i) acc += qv[i] * mean[i];
                    }
                    best = std::max(best, acc);
                }
                total += best;
            }
            per_layer[il][c] = total / q.n_tokens;
        }
    }
    std::vector<float> out((size_t) n_chunks, std::numeric_limits<float>::quiet_NaN());
    if (quest) {
        // Quest bounds live on each layer's own scale, and retrieval shows up in a few middle layers only
        // (SmolLM2: 12-21 attend to a passkey, the rest do not); a plain mean over layers drowned it
        // (needle rank ~25 of 45), z-scoring each layer over chunks and taking the max ranked it 3-6.
        z_normalise_layers(per_layer, *this);
        for (int64_t c = 0; c < n_chunks; ++c) {
            if (!has(c)) continue;
            double best = -std::numeric_limits<double>::infinity();
            for (int64_t il = 0; il < s.n_layer; ++il) best = std::max(best, per_layer[il][c]);
            out[c] = (float) best;
        }
    } else {   // qk: mean over layers of the cosine (cosines share one scale)
        for (int64_t c = 0; c < n_chunks; ++c) {
            if (!has(c)) continue;
            double total = 0.0;
            for (int64_t il = 0; il < s.n_layer; ++il) total += per_layer[il][c];
            out[c] = (float) (total / s.n_layer);
        }
    }
    return out;
}

}  // namespace kvf
