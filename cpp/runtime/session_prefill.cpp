// Session's layer-major exact prefill: the K/V of a prompt of any length, equal to a full-cache run's, in
// device memory set by the pool plus one layer's K/V of the prompt.
//
// A full-cache prefill is token-major: each step takes a batch of tokens through every layer, so every
// layer's K/V of all earlier positions must be on the device. Layer-major turns the loops around: layer l
// takes the whole prompt, in the steps a full-cache session takes (n_batch tokens; same shapes, so the
// same kernels), before layer l+1 starts. Layer l then needs only its own K/V of every position, in a
// one-layer staging pool; the hidden states wait in host memory between layers. Weights are still read
// once per step per layer, as in any prefill.
#include "runtime/session.h"
#include "common/host_memory.h"
#include "kv/kv_step_inputs.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>

namespace kvf {

namespace {

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

double ms_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// The graph reads `t` straight from host memory (a GPU's scheduler copies it in by DMA): no staging copy.
void place_in(const HostMemory & mem, ggml_tensor * t, void * at) {
    if (ggml_backend_tensor_alloc(mem.buffer(), t, at) != GGML_STATUS_SUCCESS) {
        throw std::runtime_error("could not place a tensor in host memory");
    }
}

using SchedPtr = std::unique_ptr<ggml_backend_sched, decltype(&ggml_backend_sched_free)>;
using CtxPtr = std::unique_ptr<ggml_context, decltype(&ggml_free)>;

}  // namespace

void Session::place_prompt(const int32_t * tokens, int64_t n, int64_t start) {
    // The pager places every new position chunk by chunk, evicting as a pooled prefill would; a new chunk
    // that is paged out again before the prompt ends only reserves its host image (nothing computed yet).
    const auto t0 = std::chrono::steady_clock::now();
    // A chunk the held tokens end inside keeps those rows: it counts as computed (its page-out copies them).
    const int64_t C = cfg_.chunk_tokens, end = start + n;
    for (int64_t p = start; p < end;) {
        const int64_t step = std::min(C - p % C, end - p);   // up to the next chunk boundary
        const Plan plan = pager_->plan_alloc(p, step);
        kv_->execute(plan, (start + C - 1) / C);
        pager_->apply(plan);
        p += step;
    }
    tokens_.insert(tokens_.end(), tokens, tokens + n);
    kv_->synchronize();   // held chunks' page-outs have read their blocks before any block is rewritten
    timings_.t_paging_ms += ms_since(t0);
}

ExactPrefill Session::prefill_exact(const int32_t * tokens, int64_t n, int64_t start, int64_t n_batch,
                                    const std::function<void()> & between) {
    const SessionLock held = lock();
    check_tokens(tokens, n, start);
    if (n_batch < 0) throw std::invalid_argument("prefill_exact: n_batch must be >= 0 (0: the session's)");
    if (n_batch == 0) n_batch = cfg_.n_batch;
    const int64_t C = cfg_.chunk_tokens, end = start + n;
    const Model & m = *model_;
    const ModelHparams & hp = m.hparams();
    ggml_backend_t backend = m.backend();

    // ---- the workspace, allocated before any state changes ----
    PagerConfig spc = pager_->config();   // staging: identity mapping over positions [0, end)
    spc.pool_tokens = std::max(round_up(round_up(end, kv_pad_), C), spc.min_pool_tokens());
    spc.max_tokens = spc.pool_tokens;
    KvLayout sl = kv_->layout();
    sl.n_layer = 1;
    sl.pool_tokens = spc.pool_tokens;
    PooledKV stage(backend, sl);
    spc.chunk_bytes = stage.chunk_bytes();
    KvPager stage_pager(spc);
    const int64_t lcb = kv_->layer_chunk_bytes(), n_embd = hp.n_embd;
    const bool pin = can_pin_for(backend);
    HostMemory hidden_buf((size_t) (n * n_embd) * sizeof(float), pin);
    HostMemory bounce_buf((size_t) (pager_->n_blocks() * lcb), pin);
    float * hidden = reinterpret_cast<float *>(hidden_buf.data());
    uint8_t * bounce = bounce_buf.data();
    CausalBand band(backend, spc.pool_tokens, std::min(n_batch, n), kv_pad_);
    SchedPtr sched(new_sched(), ggml_backend_sched_free);

    ExactPrefill out;
    out.logits.resize((size_t) hp.n_vocab);
    out.attention.assign((size_t) end, 0.0f);
    StepQueries queries;
    int64_t peak_compute = 0;
    const auto t0 = std::chrono::steady_clock::now();
    const SlidingWindowKV::Mark ring_start = ring_ ? ring_->mark() : SlidingWindowKV::Mark{};
    // A linear-attention layer's state moves on step by step and cannot go back: a copy to return to if the
    // prompt fails (host memory, the state's size: ~150 MiB on Qwen3.5-27B's shape).
    const RecurrentState::Copy recurrent_start = recurrent_ ? recurrent_->copy() : RecurrentState::Copy{};
    try {
        place_prompt(tokens, n, start);
        if (recurrent_) recurrent_->place(start, n);   // every recurrent layer consumes the prompt in turn
        const std::vector<int64_t> blocks = pager_->chunk_blocks();   // where each chunk ends: block, or -1 (host)
        // Chunks [0, c_held) hold earlier positions; chunks [c_new, c_end) get new ones (a chunk the held
        // tokens end inside is both: it goes into staging whole and comes back whole).
        const int64_t c_held = (start + C - 1) / C, c_new = start / C, c_end = (end + C - 1) / C;
        std::vector<int32_t> pos;
        for (int il = 0; il < hp.n_layer; ++il) {
            const bool last_layer = il == hp.n_layer - 1, swa = hp.is_swa(il), pooled = hp.is_pooled(il);
            const int64_t pl = hp.kv_index(il);   // the layer's row in the pool (or its ring, or its state)
            auto t_io = std::chrono::steady_clock::now();
            if (swa) {
                // A sliding-window layer runs the prompt through its own ring, from where the ring stood
                // before the prompt (every ring layer takes the same positions, one layer after another).
                ring_->rewind_to(ring_start);
            } else if (pooled) {
                // Layer il of the held positions into staging block c (resident chunks through the bounce buffer).
                stage_pager.reset();
                if (start > 0) stage_pager.apply(stage_pager.plan_alloc(0, start));
                int64_t n_bounced = 0;
                for (int64_t c = 0; c < c_held; ++c) {
                    if (blocks[c] >= 0) kv_->get_layer_async(blocks[c], pl, bounce + (n_bounced++) * lcb);
                }
                kv_->synchronize();
                n_bounced = 0;
                for (int64_t c = 0; c < c_held; ++c) {
                    stage.set_layer_async(c, 0, blocks[c] >= 0 ? bounce + (n_bounced++) * lcb : kv_->image_layer(c, pl));
                }
            }
            timings_.t_prefill_io_ms += ms_since(t_io);

            const int64_t layer_step = swa ? std::min(n_batch, ring_->max_step()) : n_batch;
            for (int64_t p0 = start; p0 < end;) {
                const int64_t mt = std::min(layer_step, end - p0);
                const bool final_step = p0 + mt == end;
                Plan plan;
                KvKeyOrder order;
                if (swa) {
                    plan = ring_->place(p0, mt);
                    order = ring_->key_order();
                } else if (pooled) {
                    plan = stage_pager.plan_alloc(p0, mt);
                    stage_pager.apply(plan);
                    order = kv_key_order(stage_pager, sl, false, kv_pad_);
                }

                const auto t_graph = std::chrono::steady_clock::now();
                CtxPtr ctx(new_graph_ctx(), ggml_free);
                GraphCtx g;
                g.ctx = ctx.get();
                g.gf = ggml_new_graph_custom(g.ctx, graph_size(), false);
                g.kv = &stage;
                g.one_layer_kv = true;
                g.recurrent = recurrent_.get();   // a recurrent layer carries its state from step to step
                g.n_tokens = mt;
                g.n_outputs = last_layer ? 1 : mt;
                g.flash_attn = flash_attn_;
                // Only pooled layers are scored: they alone keep the last tokens' attention and queries.
                g.n_attn_tokens = final_step && pooled ? std::min(mt, k_capture_tokens) : 0;
                g.n_query_tokens = final_step && pooled && summaries_ ? std::min(mt, k_capture_tokens) : 0;
                g.in.tokens = il == 0 ? ggml_new_tensor_1d(g.ctx, GGML_TYPE_I32, mt) : nullptr;
                // A linear-attention layer has no positions (nothing rotates): an input the graph never reads stays unallocated.
                g.in.positions = hp.is_recurrent(il) ? nullptr : ggml_new_tensor_1d(g.ctx, GGML_TYPE_I32, mt);
                g.in.out_ids = last_layer && mt > 1 ? ggml_new_tensor_1d(g.ctx, GGML_TYPE_I32, 1) : nullptr;
                ggml_tensor * h_in = il == 0 ? nullptr : ggml_new_tensor_2d(g.ctx, GGML_TYPE_F32, n_embd, mt);
                for (ggml_tensor * t : {g.in.tokens, g.in.positions, g.in.out_ids}) {
                    if (t) ggml_set_input(t);
                }
                if (h_in) place_in(hidden_buf, h_in, hidden + (p0 - start) * n_embd);   // the layer's input tile, in place
                KvStepInputs * step_kv = nullptr;   // none for a recurrent layer
                if (swa) {   // the ring's mask (window and ring order) is uploaded: small, and no band has it
                    g.ring = &ring_->kv();
                    g.n_ring_kv = order.n_kv;
                    g.ring_in = kv_step_inputs_new(g.ctx, ring_->kv().layout(), mt, order.n_kv, false);
                    step_kv = &g.ring_in;
                } else if (pooled) {
                    g.n_kv = order.n_kv;
                    g.in.kv = kv_step_inputs_new(g.ctx, sl, mt, order.n_kv, false, band.mask(g.ctx, order.n_kv, mt, p0));
                    step_kv = &g.in.kv;
                }
                ggml_tensor * y = m.arch().layer(g, m, il, h_in ? h_in : m.arch().embed(g, m));
                if (last_layer) {
                    y = build_logits(g, m, y);   // [n_vocab, 1]: the step's last token
                } else {
                    ggml_set_output(y);
                    ggml_build_forward_expand(g.gf, y);
                }
                ggml_backend_sched_reset(sched.get());
                if (!ggml_backend_sched_alloc_graph(sched.get(), g.gf)) {
                    throw std::runtime_error("could not allocate the layer-major prefill graph (out of memory?)");
                }
                peak_compute = std::max(peak_compute, (int64_t) ggml_backend_sched_get_buffer_size(sched.get(), backend));
                timings_.t_prefill_graph_ms += ms_since(t_graph);
                t_io = std::chrono::steady_clock::now();

                pos.resize((size_t) mt);
                for (int64_t i = 0; i < mt; ++i) pos[i] = (int32_t) (p0 + i);
                if (g.in.tokens) ggml_backend_tensor_set(g.in.tokens, tokens + (p0 - start), 0, mt * sizeof(int32_t));
                if (g.in.positions) ggml_backend_tensor_set(g.in.positions, pos.data(), 0, mt * sizeof(int32_t));
                if (g.in.out_ids) {
                    const int32_t last = (int32_t) (mt - 1);
                    ggml_backend_tensor_set(g.in.out_ids, &last, 0, sizeof(int32_t));
                }
                if (step_kv) kv_step_inputs_set(*step_kv, swa ? ring_->kv().layout() : sl, order, plan, pos.data(), input_scratch_);
                timings_.t_prefill_io_ms += ms_since(t_io);
                if (ggml_backend_sched_graph_compute(sched.get(), g.gf) != GGML_STATUS_SUCCESS) {
                    throw std::runtime_error("ggml graph compute failed");
                }
                timings_.n_computes++;

                t_io = std::chrono::steady_clock::now();   // includes waiting for the compute to finish
                if (!last_layer) ggml_backend_tensor_get(y, hidden + (p0 - start) * n_embd, 0, ggml_nbytes(y));
                if (last_layer && final_step) ggml_backend_tensor_get(y, out.logits.data(), 0, ggml_nbytes(y));
                if (final_step && pooled) {
                    // The last tokens' attention, staging slot j = position j: max over queries and layers.
                    const ggml_tensor * a = g.attn.at(0);   // [n_kv, n_q]
                    std::vector<float> rows((size_t) ggml_nelements(a));
                    ggml_backend_tensor_get(a, rows.data(), 0, ggml_nbytes(a));
                    const int64_t n_kv = a->ne[0];
                    for (int64_t i = 0; i < a->ne[1]; ++i) {
                        for (int64_t j = 0; j < std::min(n_kv, end); ++j) {
                            out.attention[j] = std::max(out.attention[j], rows[(size_t) (i * n_kv + j)]);
                        }
                    }
                    if (g.n_query_tokens > 0) {   // the qk / quest scorers' queries, as a forward step keeps them
                        const ggml_tensor * q = g.queries.at(0);   // [head_dim, n_head, n_q]
                        const int64_t n_pooled = hp.n_pooled_layers();
                        if (pl == 0) {
                            queries = StepQueries{n_pooled, q->ne[2], q->ne[1], q->ne[0], {}};
                            queries.data.resize((size_t) (n_pooled * ggml_nelements(q)));
                        }
                        ggml_backend_tensor_get(q, queries.data.data() + pl * ggml_nelements(q), 0, ggml_nbytes(q));
                    }
                }
                timings_.t_prefill_io_ms += ms_since(t_io);
                p0 += mt;
            }

            if (pooled) {
                // Layer il of the new chunks to where the pager placed them: blocks through the bounce buffer,
                // evicted chunks straight into their host images.
                t_io = std::chrono::steady_clock::now();
                int64_t n_bounced = 0;
                for (int64_t c = c_new; c < c_end; ++c) {
                    stage.get_layer_async(c, 0, blocks[c] >= 0 ? bounce + (n_bounced++) * lcb : kv_->image_layer(c, pl));
                }
                stage.synchronize();
                n_bounced = 0;
                for (int64_t c = c_new; c < c_end; ++c) {
                    const uint8_t * layer = blocks[c] >= 0 ? bounce + (n_bounced++) * lcb : kv_->image_layer(c, pl);
                    if (blocks[c] >= 0) kv_->set_layer_async(blocks[c], pl, layer);
                    if (summaries_ && (c + 1) * C <= end) summaries_->seal_layer(c, pl, kv_->layout(), layer);   // K first
                }
                timings_.t_prefill_io_ms += ms_since(t_io);
            }
            if (between) between();
        }
        kv_->synchronize();
    } catch (...) {
        kv_->synchronize();
        if (ring_) ring_->rewind_to(ring_start);
        if (recurrent_) recurrent_->rewind_to(recurrent_start);
        truncate(start);   // no new position is complete before its last layer is written: forget them all
        throw;
    }
    timings_.t_compute_ms += ms_since(t0);
    prefill_queries_ = std::move(queries);
    prefill_peak_bytes_ = std::max(prefill_peak_bytes_, stage.device_bytes() + band.device_bytes() + peak_compute);
    prefill_host_bytes_ = std::max(prefill_host_bytes_, (int64_t) (hidden_buf.size() + bounce_buf.size()));
    return out;
}

SessionMemory Session::memory() const {
    const SessionLock held = lock(false);
    SessionMemory mem;
    mem.pool_bytes = kv_->device_bytes();
    mem.ring_bytes = ring_ ? ring_->device_bytes() : 0;
    mem.recurrent_bytes = recurrent_ ? recurrent_->device_bytes() : 0;
    mem.recurrent_checkpoint_bytes = recurrent_ ? recurrent_->checkpoint_bytes() : 0;
    mem.compute_bytes = (int64_t) ggml_backend_sched_get_buffer_size(sched_, model_->backend());
    mem.prefill_peak_bytes = prefill_peak_bytes_;
    mem.prefill_host_bytes = prefill_host_bytes_;
    return mem;
}

}  // namespace kvf
