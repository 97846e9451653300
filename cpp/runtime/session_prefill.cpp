// Session's layer-major exact prefill: the K/V of a prompt of any length, equal to a full-cache run's, in
// device memory set by the pool plus one layer's K/V of the prompt.
//
// A full-cache prefill is token-major: each step takes a batch of tokens through every layer, so every
// layer's K/V of all earlier positions must be on the device. Layer-major turns the loops around: layer l
// takes the whole prompt, in the steps a full-cache session takes (n_batch tokens; same shapes, so the
// same kernels), before layer l+1 starts. Layer l then needs only its own K/V of every position, in a
// one-layer staging pool; the hidden states wait in host memory between layers (runtime/hidden_states.h). Weights are still read
// once per step per layer, as in any prefill. A layer that attends an earlier layer's K/V (gemma4's shared
// K/V) needs none of its own and runs the prompt's last step only (check_shared_kv says why). The MTP head (cfg.mtp,
// model/mtp.h) runs as one more pooled layer after the trunk: its steps read the trunk's final hidden states (which
// the trunk's last layer then leaves for every position, not only the last token's logits) and write its K/V and
// carry, attending nothing; the last of them computes the logits.
//
// The pager places the prompt's positions as a pooled prefill would (new chunks paged out again only reserve their
// host image), after layer 0's steps: meanwhile another thread makes and pins the host images the evicted chunks
// will need. For each layer: the held positions' K/V go into the staging pool (from blocks through a bounce buffer,
// from host images directly); the prompt runs through the layer in steps of n_batch (the engine asks for
// PoolConfig.exact_prefill_batch(): at least 1024 with flash attention, as each step pays a fixed cost and there are
// n_layer times more of them than in a full cache); the layer's new K/V go to their blocks or host images, step by
// step on the hidden states' copy stream while the next steps compute (drain: after layer 0, whose end places the
// prompt), else at the layer's end.
// A step attends under a causal mask that is a view of a table made once per prefill (CausalBand, one per device: such
// a view cannot cross devices), which also holds the counts its positions and slot rows view, so a step uploads
// nothing, never waits for the one before and makes no mask; a step's whole mask would grow with the keys (n_kv x step
// F16: 256 MiB at 128K x 1024), so attention takes the step's queries in blocks whose mask (and on the mul_mat path
// attention matrix) fits k_attention_block_bytes, each attending only the keys up to its last position; over F16 K/V
// with flash attention blocks of k_grouped_block_bytes share calls of up to 512 queries (graph.h says why). A pooled
// layer's largest step graph is reserved before its first step, so the scheduler never grows its buffer mid-layer
// (growing waits for the device). A sliding-window layer needs no staging: it runs the prompt through its own ring;
// a linear-attention layer runs its steps in order through its state, copied first so that a failure can put it back.
// The last step of each layer captures what the prompt's last k_capture_tokens attend to (max over heads, layers,
// queries): the post-prompt reselect scores chunks from it.
//
// Device memory: weights + pool + staging (one layer's K/V of the context) + one layer's compute buffer (a step's
// activations, its FFN's for k_exact_ffn_part_rows of its rows at a time, and one attention block), freed after the
// prompt.
// On a split each device that runs a staged layer has its own staging pool (one layer's K/V of the context each), so
// a layer attends keys on its own device: with one staging pool on the output device, every step of another device's
// layers copied the keys it attends across devices (two H100s, 8B shape, 32K: 0.70x one GPU's exact prefill, R72).
// The hidden-state tiles stay on the output layer's device (a step's rows cross once per device boundary). With a
// full cache's step the bytes equal its; with a larger step or smaller query blocks they are equal within summation
// order on the flash path and byte-equal on the mul_mat path (each query's row alone). An exception (Ctrl-C between
// layers included) forgets the new positions: the session holds what it held.
#include "runtime/session.h"
#include "common/host_memory.h"
#include "kv/kv_step_inputs.h"
#include "model/ffn.h"
#include "model/graph.h"
#include "runtime/hidden_states.h"
#include "model/mtp.h"
#include "model/rpc.h"

#include <algorithm>
#include <chrono>
#include <future>
#include <stdexcept>
#include <unordered_set>
#include <utility>

namespace kvf {

namespace {

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

double ms_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

using SchedPtr = std::unique_ptr<ggml_backend_sched, decltype(&ggml_backend_sched_free)>;
using CtxPtr = std::unique_ptr<ggml_context, decltype(&ggml_free)>;

// Layers without K/V of their own (gemma4's last attention.shared_kv_layers: ModelHparams::has_kv, kv_source)
// attend their source layer's and write none, so what they compute for a position feeds only that position in
// the next layer: of a prompt, only the last token's logits need them. Layer-major runs them over the prompt's
// last step alone, after every layer with K/V ran the whole prompt. Then the staging pool still holds the last
// global layer's K/V of every position, and the rings hold the window before every query of that step (a step
// takes at most ring rows - window tokens): what a full cache's last step attends, in the same slots under the
// same masks, so the logits are its bytes. It costs no workspace (keeping a sliding-window source's ring rows of
// every step, so that each step could run, would cost that layer's K/V of the prompt) and saves those layers'
// other steps. Throws, naming the layer, where this cannot serve: a global layer reading another layer's K/V
// than the last one staged, or a layer with K/V after a shared one (which would need every position's output).
void check_shared_kv(const ModelHparams & hp) {
    int64_t last_staged = -1, first_shared = -1;
    for (int64_t il = 0; il < hp.n_layer; ++il) {
        std::string why;
        if (hp.has_kv(il)) {
            if (first_shared >= 0) why = "has K/V of its own after layer " + std::to_string(first_shared) + ", which has none";
            if (hp.is_pooled(il)) last_staged = il;
        } else {
            if (first_shared < 0) first_shared = il;
            const int64_t src = hp.kv_source(il);
            if (!hp.is_swa(il) && src != last_staged) {
                why = "attends the K/V of layer " + std::to_string(src) + ", not of the last global layer before it";
            }
        }
        if (!why.empty()) {
            throw std::invalid_argument("prefill_exact: layer " + std::to_string(il) + " of this " + hp.arch + " model " +
                                        why + ": layer-major prefill cannot run it; use prefill='pooled' or a pool that "
                                        "holds the prompt");
        }
    }
}

// A graph's nodes and leafs (the tensors its nodes read that no op makes: weights, inputs, the band's): what ggml's
// allocator compares before it reuses a reservation.
std::pair<int, int> graph_shape(ggml_cgraph * gf) {
    std::unordered_set<const ggml_tensor *> leafs;
    const int n = ggml_graph_n_nodes(gf);
    for (int i = 0; i < n; ++i) {
        for (const ggml_tensor * src : ggml_graph_node(gf, i)->src) {
            if (src && src->op == GGML_OP_NONE) leafs.insert(src);
        }
    }
    return {n, (int) leafs.size()};
}

}  // namespace

// One layer-major exact prefill of a session (top of this file): the workspace is allocated when it is made,
// before any state changes; run() stages each layer, runs its steps, writes its new K/V back, and on any
// exception rolls the session back to what it held. A nested class of Session: it works on the session's own
// memories, as the session's methods do.
class Session::ExactPrefillPass {
public:
    ExactPrefillPass(Session & s, const int32_t * tokens, int64_t n, int64_t start, const ExactPrefillOptions & o,
                     const std::function<void()> & between);
    // Up to max_steps more steps (0: the rest), staging and writing back layers as their steps begin and end; true
    // once every step ran. On any exception the session is rolled back first.
    bool advance(int64_t max_steps);
    ExactPrefill finish();   // after the last advance
    void roll_back();
    size_t n_steps() const { return steps_.size(); }
    size_t steps_run() const { return k_; }

private:
    struct LayerKind {
        bool mtp, swa, recurrent, has_kv, pooled;
        int64_t pl;   // the layer's row in the pool (or its ring, or its state)
    };
    // Step k's graph: its layer over its positions, attending n_kv slots of the staging pool or the ring.
    struct StepGraph {
        CtxPtr ctx{nullptr, ggml_free};
        GraphCtx g;
        ggml_tensor * y = nullptr;   // the layer's output, or the logits on the last layer
    };

    LayerKind kind(int il) const {
        if (il == hp_.n_layer) return {true, false, false, true, true, s_.kv_->layout().n_layer - 1};
        return {false, hp_.is_swa(il), hp_.is_recurrent(il), hp_.has_kv(il), hp_.is_pooled(il), hp_.kv_index(il)};
    }
    // A global layer attends the staging pool: its own K/V, or (shared K/V) its source's, staged last.
    bool attends_staging(int il) const { const LayerKind k = kind(il); return k.mtp || (!k.swa && !k.recurrent); }
    PooledKV & stage_of(int il) const;
    size_t stage_device(int il) const;   // the device whose staging pool layer il attends
    void make_stages();
    void make_sparse_index();
    void plan_steps();
    bool keeps_state(int il) const;
    void keep_checkpoint_part(int il);
    KvKeyOrder staging_order(int64_t filled) const;
    StepGraph build_graph(size_t k, int64_t n_kv, bool measure);
    size_t graph_nodes(int64_t dense_tokens) const;
    void stage_layer(int il);
    void reserve_layer(int il, size_t k_end);
    void run_step(size_t k);
    void capture(const GraphCtx & g, const LayerKind & lk);
    bool drains_per_step(int il) const;
    void drain(int il, int64_t upto, ggml_backend_t stream);
    void write_back(int il);
    void account();
    size_t layer_end(int il) const;

    Session & s_;
    const Model & m_;
    const ModelHparams & hp_;
    const int32_t * tokens_;
    const int64_t n_, start_, end_, C_, n_batch_;
    // A step's blocks of queries share flash attention calls: a dense pass over F16 K/V (ggml-cuda would convert
    // quantized K/V for every sequence of a call) unless blocks_per_call is 1.
    const bool groups_;
    const int64_t attention_block_bytes_;
    const int64_t ffn_part_rows_;   // ExactPrefillOptions::ffn_part_rows
    const int64_t checkpoint_at_;   // the position checkpoint_before_last keeps the state at (-1: none)
    RecurrentState::Copy checkpoint_;   // sized for the state, filled layer by layer (keep_checkpoint_part)
    const std::function<void()> & between_;
    const ggml_backend_t backend_;
    const int n_stack_;   // the layers run, the MTP head's last: layer n_layer, pooled, attending nothing
    PagerConfig spc_;     // staging: identity mapping over positions [0, end)
    KvLayout sl_;
    std::vector<std::unique_ptr<PooledKV>> stages_;   // per device (make_stages)
    std::unique_ptr<KvPager> stage_pager_;
    int64_t lcb_;
    std::vector<HiddenStates::Step> steps_;
    std::unique_ptr<HiddenStates> hidden_;
    std::unique_ptr<HostMemory> bounce_buf_;
    std::vector<std::unique_ptr<CausalBand>> bands_;   // one per device (top of this file)
    const SparseParams sparse_;
    std::vector<std::unique_ptr<SparseIndex>> sparse_index_;   // per device with a staging pool (sparse prefill only)
    SchedPtr sched_{nullptr, ggml_backend_sched_free};
    ExactPrefill out_;
    std::vector<float> coverage_;   // per pooled layer (capture; sparse only)
    StepQueries queries_;
    int64_t peak_compute_ = 0;
    std::chrono::steady_clock::time_point t0_;
    SlidingWindowKV::Mark ring_start_{};
    std::vector<std::unique_ptr<ContextMemory::SavePoint>> saved_;   // one per s_.memories_, in order
    // Chunks [0, c_held) hold earlier positions; chunks [c_new, c_end) get new ones (a chunk the held tokens
    // end inside is both: it goes into staging whole and comes back whole).
    int64_t c_held_, c_new_, c_end_;
    std::future<std::vector<std::unique_ptr<HostMemory>>> slabs_;
    std::vector<int64_t> blocks_;   // where each chunk is read from (block, or -1: host)
    std::vector<int64_t> bounce_slot_;   // per new chunk with a block: its place in the bounce buffer
    int64_t drained_ = 0;           // the layer's new chunks before this one are on their way out (drain)
    bool drain_per_step_ = false;   // the layer's new chunks leave step by step (drains_per_step)
    std::vector<int32_t> pos_;
    size_t k_ = 0;                  // the step
    std::pair<int, int> layer_shape_;   // the layer's first step's graph_shape
    int il_ = 0;                    // the layer whose steps run (n_stack_: all ran)
    bool begun_ = false, layer_open_ = false;   // the prompt placed for the recurrent layers; il_ staged
    CtxPtr queued_ctx_{nullptr, ggml_free};   // the graph still running while the next one is built
};

Session::ExactPrefillPass::ExactPrefillPass(Session & s, const int32_t * tokens, int64_t n, int64_t start,
                                            const ExactPrefillOptions & o, const std::function<void()> & between)
    : s_(s), m_(*s.model_), hp_(m_.hparams()), tokens_(tokens), n_(n), start_(start), end_(start + n),
      C_(s.cfg_.chunk_tokens), n_batch_(o.n_batch), groups_(s.flash_attn_ && !o.sparse.on() && s.cfg_.kv_type == "f16" && o.blocks_per_call != 1),
      attention_block_bytes_(o.attention_block_bytes ? o.attention_block_bytes
                                                      : groups_ ? k_grouped_block_bytes : k_attention_block_bytes),
      ffn_part_rows_(o.ffn_part_rows ? o.ffn_part_rows : k_exact_ffn_part_rows),
      checkpoint_at_(o.checkpoint_before_last && s.recurrent_ && n >= 2 ? start + n - 1 : -1),
      checkpoint_(checkpoint_at_ >= 0 ? s.recurrent_->blank(checkpoint_at_) : RecurrentState::Copy{}), between_(between),
      backend_(m_.backend()), n_stack_((int) hp_.n_layer + (s.cfg_.mtp ? 1 : 0)), spc_(s.pager_->config()),
      sl_(s.kv_->layout()), lcb_(s.kv_->layer_chunk_bytes()), sparse_(o.sparse) {
    check_shared_kv(hp_);
    spc_.pool_tokens = std::max(round_up(round_up(end_, s_.kv_pad_), C_), spc_.min_pool_tokens());
    spc_.max_tokens = spc_.pool_tokens;
    sl_.n_layer = 1;
    sl_.pool_tokens = spc_.pool_tokens;
    make_stages();
    spc_.chunk_bytes = stage_of(n_stack_ - 1).chunk_bytes();
    stage_pager_ = std::make_unique<KvPager>(spc_);
    const bool pin = can_pin_for(backend_);
    plan_steps();
    hidden_ = std::make_unique<HiddenStates>(backend_, hp_.n_embd, start_, n_, steps_, pin, s_.prefill_rows_);
    bounce_buf_ = std::make_unique<HostMemory>((size_t) (s_.pager_->n_blocks() * lcb_), pin);
    // The band's table holds the largest block of queries any layer asks a mask for: the layer with the fewest heads.
    int64_t fewest_heads = hp_.n_head_of(0);
    for (int il = 1; il < (int) hp_.n_layer; ++il) fewest_heads = std::min(fewest_heads, hp_.n_head_of(il));
    const int64_t block_rows = std::min({n_batch_, n_, attention_block_rows(spc_.pool_tokens, attention_bytes_per_key(
                                                           s_.flash_attn_, fewest_heads), attention_block_bytes_)});
    const int64_t per_call = o.blocks_per_call ? o.blocks_per_call : std::min(n_batch_, k_max_query_block) / block_rows;
    const int64_t group = groups_ ? std::clamp<int64_t>(n_batch_ / block_rows, 1, per_call) : 1;
    for (int d = 0; d < m_.n_devices(); ++d) bands_.push_back(std::make_unique<CausalBand>(m_.device_backend(d), spc_.pool_tokens,
                                                                                           block_rows, s_.kv_pad_, group));
    if (sparse_.on()) make_sparse_index();
    sched_.reset(s_.new_sched(graph_nodes(n_batch_)));
    out_.logits.resize((size_t) hp_.n_vocab);
    out_.attention.assign((size_t) end_, 0.0f);
    t0_ = std::chrono::steady_clock::now();
    // The rings and the linear-attention state move on layer by layer and cannot go back: what to return to if the
    // prompt fails.
    if (s_.ring_) ring_start_ = s_.ring_->mark();   // each ring layer places the prompt's positions again
    for (const ContextMemory * m : s_.memories_) saved_.push_back(m->save_point());
    c_held_ = (start_ + C_ - 1) / C_;
    c_new_ = start_ / C_;
    c_end_ = (end_ + C_ - 1) / C_;
    // The host images the prompt's evicted chunks will need are made (pinned) on another thread while layer 0
    // computes; the pager places the prompt after that (layer 0's K/V are the first to go anywhere).
    slabs_ = std::async(std::launch::async, [kv = s_.kv_.get(),
                                             n_slots = s_.kv_->host_slots_short(std::max<int64_t>(0, c_end_ - s_.pager_->n_blocks()))] {
        return kv->make_slabs(n_slots);
    });
}

// One staging pool per device that runs a layer with staged K/V of its own (top of this file); a layer without
// K/V of its own reads the one its source wrote, the nearest staged layer before it (check_shared_kv).
void Session::ExactPrefillPass::make_stages() {
    stages_.resize((size_t) m_.n_devices());
    for (int il = 0; il < n_stack_; ++il) {
        std::unique_ptr<PooledKV> & st = stages_[(size_t) m_.device_of(il)];
        if (attends_staging(il) && kind(il).has_kv && !st) {
            st = std::make_unique<PooledKV>(LayerBackends{m_.device_backend(m_.device_of(il))}, sl_);
        }
    }
    if (std::none_of(stages_.begin(), stages_.end(), [](const auto & st) { return st != nullptr; })) {
        stages_[(size_t) m_.device_of((int) hp_.n_layer)] = std::make_unique<PooledKV>(LayerBackends{backend_}, sl_);   // its chunk size
    }
}

// A sparse prefill's chunk means and mask band beside each staging pool (model/sparse_attention.h).
void Session::ExactPrefillPass::make_sparse_index() {
    sparse_.check(C_);
    if (!s_.flash_attn_) throw std::invalid_argument("sparse prefill: needs flash attention (flash_attn=True)");
    sparse_index_.resize(stages_.size());
    for (size_t d = 0; d < stages_.size(); ++d) {
        if (!stages_[d]) continue;
        sparse_index_[d] = std::make_unique<SparseIndex>(m_.device_backend((int) d), sparse_, C_, spc_.pool_tokens / C_,
                                                         std::max(sl_.n_embd_k, sl_.n_embd_v), s_.kv_pad_);
    }
}

size_t Session::ExactPrefillPass::stage_device(int il) const {
    int src = il;
    while (src > 0 && !(attends_staging(src) && kind(src).has_kv)) --src;
    const size_t d = (size_t) m_.device_of(src);
    if (stages_[d]) return d;
    return (size_t) (std::find_if(stages_.begin(), stages_.end(), [](const auto & x) { return x != nullptr; }) - stages_.begin());
}

PooledKV & Session::ExactPrefillPass::stage_of(int il) const { return *stages_[stage_device(il)]; }

// The steps, layer by layer: a sliding-window layer's are capped by its ring. A layer without K/V of its own
// takes only the last of the steps a ring layer takes (check_shared_kv), which every layer kind can take.
void Session::ExactPrefillPass::plan_steps() {
    const int64_t ring_step = s_.ring_ ? std::min(n_batch_, s_.ring_->max_step()) : n_batch_;
    const int64_t last_p0 = start_ + (n_ - 1) / ring_step * ring_step;
    for (int il = 0; il < n_stack_; ++il) {
        if (!kind(il).has_kv) {
            steps_.push_back({il, last_p0, end_ - last_p0});
            continue;
        }
        const int64_t layer_step = kind(il).swa ? ring_step : n_batch_;
        const auto add_steps = [&](int64_t from, int64_t to) {
            for (int64_t p0 = from; p0 < to; p0 += layer_step) steps_.push_back({il, p0, std::min(layer_step, to - p0)});
        };
        const int64_t cut = keeps_state(il) ? checkpoint_at_ : end_;   // the state before the last token is kept
        add_steps(start_, cut);
        add_steps(cut, end_);
    }
}

// Whether layer il carries state from position to position that checkpoint_before_last keeps: a linear-attention
// layer's, or the MTP head's carry.
bool Session::ExactPrefillPass::keeps_state(int il) const {
    if (checkpoint_at_ < 0) return false;
    return kind(il).recurrent || (kind(il).mtp && s_.recurrent_->mtp_carry() != nullptr);
}

// After the step that ends at checkpoint_at_ (nothing later queued yet): the layer's part of the checkpoint.
void Session::ExactPrefillPass::keep_checkpoint_part(int il) {
    ggml_backend_sched_synchronize(sched_.get());
    s_.recurrent_->copy_part_into(kind(il).mtp ? s_.recurrent_->n_layer() : kind(il).pl, checkpoint_);
}

// The staging pool's keys once positions [0, filled) are in: slot j holds position j, so the step attends the first
// filled slots, padded. kv_key_order would copy every slot's position (8 MiB at 1M) on the host at every step: at
// 1M positions that took as long as the step's compute (a 1M sparse prefill ran at half its 256K rate, R98).
KvKeyOrder Session::ExactPrefillPass::staging_order(int64_t filled) const {
    KvKeyOrder o;
    o.n_kv = std::min(round_up(filled, s_.kv_pad_), spc_.pool_tokens);
    return o;
}

// A step graph's node budget; dense_tokens: its queries that may attend a pair per call (a sparse prefill's dense
// last step, graph.cpp: pair_queries), ~3 nodes each.
size_t Session::ExactPrefillPass::graph_nodes(int64_t dense_tokens) const {
    return s_.graph_size() + (sparse_.on() ? 4 * (size_t) dense_tokens : 0);
}

// measure: only its shapes count (ggml_backend_sched_reserve); nothing of it is queued.
Session::ExactPrefillPass::StepGraph Session::ExactPrefillPass::build_graph(size_t k, int64_t n_kv, bool measure) {
    const int il = steps_[k].layer;
    const int64_t p0 = steps_[k].p0, mt = steps_[k].n;
    const bool last_layer = il == n_stack_ - 1, final_step = p0 + mt == end_;
    const bool before_last = p0 + mt == checkpoint_at_ && keeps_state(il);   // its end is the checkpoint's
    const LayerKind lk = kind(il);
    const size_t n_nodes = graph_nodes(final_step ? mt : 0);
    StepGraph sg;
    sg.ctx.reset(s_.new_graph_ctx(n_nodes));
    GraphCtx & g = sg.g;
    g.ctx = sg.ctx.get();
    g.gf = ggml_new_graph_custom(g.ctx, n_nodes, false);
    g.kv = &stage_of(il);
    g.one_layer_kv = true;
    g.recurrent = s_.recurrent_.get();   // a recurrent layer carries its state from step to step
    g.n_tokens = mt;
    g.n_outputs = last_layer ? 1 : mt;
    g.flash_attn = s_.flash_attn_;
    g.attention_block_bytes = attention_block_bytes_;
    g.ffn_part_rows = ffn_part_rows_;
    if (sparse_.on() && attends_staging(il)) {   // a layer's first step summarizes every chunk held before the prompt too
        const bool layer_first = k == 0 || steps_[k - 1].layer != il;
        g.sparse = {sparse_index_[stage_device(il)].get(), layer_first ? 0 : p0 / C_, final_step};
    }
    // Only the trunk's pooled layers are scored: they alone keep the last tokens' attention and queries.
    const bool scored = final_step && lk.pooled && !lk.mtp;
    g.n_attn_tokens = scored ? std::min(mt, k_capture_tokens) : 0;
    g.n_query_tokens = scored && s_.summaries_ ? std::min(mt, k_capture_tokens) : 0;
    g.mtp_kv_layer = lk.mtp ? 0 : -1;   // the head's K/V go to the one-layer staging pool
    // Per-layer embeddings (gemma4) read the tokens in every layer, the MTP head its own embeddings.
    g.in.tokens = il == 0 || hp_.n_embd_per_layer > 0 || lk.mtp ? ggml_new_tensor_1d(g.ctx, GGML_TYPE_I32, mt) : nullptr;
    // Positions and the output row are views of the device's band (CausalBand: nothing uploaded, so no step waits
    // for the one before), a sliding-window layer's positions an input as its ring's mask is. A linear-attention
    // layer has no positions (nothing rotates): an input the graph never reads stays unallocated.
    const CausalBand & band = *bands_[(size_t) m_.device_of(il)];
    g.in.positions = lk.recurrent ? nullptr : lk.swa ? ggml_new_tensor_1d(g.ctx, GGML_TYPE_I32, mt) : band.counts_i32(g.ctx, p0, mt);
    g.in.out_ids = last_layer && mt > 1 ? band.counts_i32(g.ctx, mt - 1, 1) : nullptr;
    ggml_tensor * h_in = hidden_->input(g.ctx, k, measure);
    for (ggml_tensor * t : {g.in.tokens, lk.swa ? g.in.positions : nullptr}) {
        if (t) ggml_set_input(t);
    }
    if (lk.swa) {   // the ring's mask (window and ring order) is uploaded: small, and no band has it
        g.ring = &s_.ring_->kv();
        g.n_ring_kv = n_kv;
        g.ring_in = kv_step_inputs_new(g.ctx, s_.ring_->kv().layout(), mt, n_kv, false);
    } else if (attends_staging(il)) {
        g.n_kv = n_kv;
        g.in.kv = kv_step_inputs_new(g.ctx, sl_, mt, n_kv, false, &band, p0);
    }
    if (!lk.has_kv) kv_step_inputs_reads_only(lk.swa ? g.ring_in : g.in.kv);
    sg.y = lk.mtp ? build_mtp_follow(g, m_, h_in) : m_.arch().layer(g, m_, il, h_in ? h_in : m_.arch().embed(g, m_));
    if (last_layer) {
        sg.y = build_logits(g, m_, sg.y);   // [n_vocab, 1]: the step's last token
    } else {
        ggml_build_forward_expand(g.gf, hidden_->output(g.ctx, k, sg.y));
    }
    return sg;
}

// Before layer il's steps: a sliding-window layer's ring back where it stood before the prompt (every ring layer
// takes the same positions, one layer after another); a pooled layer's held positions into staging (resident
// chunks through the bounce buffer). A layer without K/V reads what its source left, at the prompt's end.
void Session::ExactPrefillPass::stage_layer(int il) {
    const LayerKind lk = kind(il);
    if (!lk.has_kv) return;
    if (lk.swa) {
        s_.ring_->rewind_to(ring_start_);
        return;
    }
    if (!lk.pooled) return;
    if (c_held_ > 0) hidden_->synchronize_copies();   // the last layer's copies out of staging and the bounce buffer
    stage_pager_->reset();
    if (start_ > 0) stage_pager_->apply(stage_pager_->plan_alloc(0, start_));
    uint8_t * bounce = bounce_buf_->data();
    int64_t n_bounced = 0;
    for (int64_t c = 0; c < c_held_; ++c) {
        if (blocks_[c] >= 0) s_.kv_->get_layer_async(blocks_[c], lk.pl, bounce + (n_bounced++) * lcb_);
    }
    s_.kv_->synchronize();
    n_bounced = 0;
    for (int64_t c = 0; c < c_held_; ++c) {
        stage_of(il).set_layer_async(c, 0, blocks_[c] >= 0 ? bounce + (n_bounced++) * lcb_ : s_.kv_->image_layer(c, lk.pl));
    }
}

// A pooled layer's steps attend ever more slots: reserved for its largest step before the first (the last before
// the final one, whose captures make another graph), the scheduler never has to grow its buffer, which means
// waiting for the step before, while the steps are queued. ggml's allocator keeps that reservation only while each
// graph has as many nodes as the reserved one (else it reserves again for the graph at hand, and the next, larger,
// step once more): every step of a layer but the last builds the same nodes (timings' n_prefill_graph_changes).
void Session::ExactPrefillPass::reserve_layer(int il, size_t k_end) {
    if (!kind(il).pooled || !hidden_->overlaps() || k_end - k_ < 3) return;
    const HiddenStates::Step & big = steps_[k_end - 2];
    const int64_t n_kv = std::min(round_up(big.p0 + big.n, s_.kv_pad_), spc_.pool_tokens);
    const auto t_graph = std::chrono::steady_clock::now();
    StepGraph measure = build_graph(k_end - 2, n_kv, true);
    if (!ggml_backend_sched_reserve(sched_.get(), measure.g.gf)) {
        throw std::runtime_error("could not allocate the layer-major prefill graph (out of memory?)");
    }
    s_.timings_.t_prefill_graph_ms += ms_since(t_graph);
}

void Session::ExactPrefillPass::run_step(size_t k) {
    const int il = steps_[k].layer;
    const int64_t p0 = steps_[k].p0, mt = steps_[k].n;
    const bool last_layer = il == n_stack_ - 1, final_step = p0 + mt == end_;
    const bool before_last = p0 + mt == checkpoint_at_ && keeps_state(il);   // its end is the checkpoint's
    const LayerKind lk = kind(il);
    auto t_io = std::chrono::steady_clock::now();
    Plan plan;
    KvKeyOrder order;
    if (!lk.has_kv) {   // reads only: the keys every position of the prompt left
        plan.span_start = p0;
        plan.span_n = mt;
        order = lk.swa ? s_.ring_->key_order() : staging_order(end_);
    } else if (lk.swa) {
        plan = s_.ring_->place(p0, mt);
        order = s_.ring_->key_order();
    } else if (lk.pooled) {
        plan = stage_pager_->plan_alloc(p0, mt);
        stage_pager_->apply(plan);
        order = staging_order(p0 + mt);
    }

    const auto t_graph = std::chrono::steady_clock::now();
    StepGraph sg = build_graph(k, order.n_kv, false);
    GraphCtx & g = sg.g;
    s_.timings_.n_prefill_paired_blocks += g.n_paired_blocks;
    s_.timings_.n_prefill_shared_calls += g.n_shared_calls;
    if (!final_step && !before_last) {   // the layer's reservation (reserve_layer) holds only for graphs of as many nodes and leafs
        const std::pair<int, int> shape = graph_shape(g.gf);
        if (k == 0 || steps_[k - 1].layer != il) layer_shape_ = shape;
        s_.timings_.n_prefill_graph_changes += shape != layer_shape_;
    }
    KvStepInputs * step_kv = lk.swa ? &g.ring_in : attends_staging(il) ? &g.in.kv : nullptr;   // none: a recurrent layer
    ggml_backend_sched_reset(sched_.get());
    if (!ggml_backend_sched_alloc_graph(sched_.get(), g.gf)) {
        check_rpc_connections(sched_.get());   // a lost RPC device allocates nothing
        throw std::runtime_error("could not allocate the layer-major prefill graph (out of memory?)");
    }
    peak_compute_ = std::max(peak_compute_, sched_device_bytes(m_, sched_.get()));
    s_.timings_.t_prefill_graph_ms += ms_since(t_graph);
    t_io = std::chrono::steady_clock::now();

    pos_.resize((size_t) mt);
    for (int64_t i = 0; i < mt; ++i) pos_[i] = (int32_t) (p0 + i);
    if (g.in.tokens) ggml_backend_tensor_set(g.in.tokens, tokens_ + (p0 - start_), 0, mt * sizeof(int32_t));
    if (lk.swa) ggml_backend_tensor_set(g.in.positions, pos_.data(), 0, mt * sizeof(int32_t));
    if (step_kv) kv_step_inputs_set(*step_kv, lk.swa ? s_.ring_->kv().layout() : sl_, order, plan, pos_.data(), s_.input_scratch_);
    s_.timings_.t_prefill_io_ms += ms_since(t_io);
    // Queued behind the step before, which may still run: this step's graph was made meanwhile (a step with an
    // uploaded input, layer 0's tokens or a ring's mask, waits for the device first). A layer's last step runs to its end: its
    // outputs are read here and its K/V copied out by write_back.
    hidden_->before_compute(k);
    if (ggml_backend_sched_graph_compute_async(sched_.get(), g.gf) != GGML_STATUS_SUCCESS) {
        throw std::runtime_error("ggml graph compute failed");
    }
    s_.timings_.n_computes++;
    t_io = std::chrono::steady_clock::now();
    if (final_step || !hidden_->overlaps()) ggml_backend_sched_synchronize(sched_.get());
    const auto drain_step = [&](ggml_backend_t stream) { drain(il, p0 + mt, stream); };
    hidden_->queued(k, last_layer ? nullptr : sg.y, drain_per_step_ ? std::function<void(ggml_backend_t)>(drain_step) : nullptr);
    if (last_layer && final_step) ggml_backend_tensor_get(sg.y, out_.logits.data(), 0, ggml_nbytes(sg.y));
    if (final_step && lk.pooled && !lk.mtp) capture(g, lk);
    s_.timings_.t_prefill_io_ms += ms_since(t_io);
    if (final_step) check_rpc_connections(sched_.get());   // per layer: a lost RPC device reads as zeros
    if (before_last) keep_checkpoint_part(il);
    queued_ctx_ = std::move(sg.ctx);
    // A step that ran to its end is an interrupt point too (every CPU step does), so that Ctrl-C does not wait
    // for a whole layer of a long prompt; a device's queued steps wait for the layer's end.
    if (between_ && !final_step && !hidden_->overlaps()) between_();
}

// The last tokens' attention, staging slot j = position j: max over queries and layers; and the qk / quest
// scorers' queries, as a forward step keeps them.
void Session::ExactPrefillPass::capture(const GraphCtx & g, const LayerKind & lk) {
    const ggml_tensor * a = g.attn.at(0);   // [n_kv, n_q]
    std::vector<float> rows((size_t) ggml_nelements(a));
    ggml_backend_tensor_get(a, rows.data(), 0, ggml_nbytes(a));
    const int64_t n_kv = a->ne[0];
    for (int64_t i = 0; i < a->ne[1]; ++i) {
        for (int64_t j = 0; j < std::min(n_kv, end_); ++j) {
            out_.attention[j] = std::max(out_.attention[j], rows[(size_t) (i * n_kv + j)]);
        }
    }
    if (sparse_.on()) {   // the share of exact attention the last block's chosen keys held (1: it saw every key)
        float share = 1.0f;
        if (!g.coverage.empty()) {
            std::vector<float> c((size_t) ggml_nelements(g.coverage[0]));
            ggml_backend_tensor_get(g.coverage[0], c.data(), 0, ggml_nbytes(g.coverage[0]));
            double sum = 0;
            for (float x : c) sum += x;
            share = (float) (sum / (double) c.size());
        }
        coverage_.resize((size_t) hp_.n_pooled_layers(), 1.0f);
        coverage_[(size_t) lk.pl] = share;
    }
    if (g.n_query_tokens > 0) {
        const ggml_tensor * q = g.queries.at(0);   // [head_dim, n_head, n_q]
        const int64_t n_pooled = hp_.n_pooled_layers();
        if (lk.pl == 0) {
            queries_ = StepQueries{n_pooled, q->ne[2], q->ne[1], q->ne[0], {}};
            queries_.data.resize((size_t) (n_pooled * ggml_nelements(q)));
        }
        ggml_backend_tensor_get(q, queries_.data.data() + lk.pl * ggml_nelements(q), 0, ggml_nbytes(q));
    }
}

// Whether layer il's new chunks leave staging step by step, on the copy stream while the next steps compute
// (drain), instead of all at the layer's end while the device waits (write_back: 19 ms a layer at 128K on an
// H100, R92). Only once the prompt is placed (after layer 0), without summaries to seal (they read the bytes on
// the host), on the copy stream's device, and with steps that end on chunk boundaries: a chunk is then written
// by one step of a layer, and the next layer's step that rewrites it waits for its input, queued after the drain.
bool Session::ExactPrefillPass::drains_per_step(int il) const {
    if (il == 0 || !kind(il).pooled || s_.summaries_ || !hidden_->overlaps() || start_ % C_ != 0 || n_batch_ % C_ != 0) return false;
    const ggml_backend_dev_t copies = ggml_backend_get_device(backend_);   // the copy stream's device
    return ggml_backend_get_device(stage_of(il).backend_of(0)) == copies &&
           ggml_backend_get_device(s_.kv_->backend_of(kind(il).pl)) == copies;
}

// Queues layer il of the new chunks complete at position `upto` (all at the prompt's end) to where the pager placed
// them: evicted chunks straight into their host images, the others to their blocks through the bounce buffer.
// stream: the copy stream (nullptr: the stage's own).
void Session::ExactPrefillPass::drain(int il, int64_t upto, ggml_backend_t stream) {
    const LayerKind lk = kind(il);
    PooledKV & stage = stage_of(il);
    for (; drained_ < c_end_ && ((drained_ + 1) * C_ <= upto || upto == end_); ++drained_) {
        const int64_t c = drained_;
        if (blocks_[c] < 0) {
            stage.get_layer_async(c, 0, s_.kv_->image_layer(c, lk.pl), stream);
            continue;
        }
        uint8_t * layer = bounce_buf_->data() + bounce_slot_[c] * lcb_;
        stage.get_layer_async(c, 0, layer, stream);
        if (stream) s_.kv_->set_layer_async(blocks_[c], lk.pl, layer, stream);   // else once the bytes are here
    }
}

// The layer's new chunks not drained yet, the host waiting for them: blocks through the bounce buffer (whose
// bytes also seal the summaries), evicted chunks straight into their host images.
void Session::ExactPrefillPass::write_back(int il) {
    const LayerKind lk = kind(il);
    if (!lk.pooled) return;
    const auto t_io = std::chrono::steady_clock::now();
    const int64_t first = drained_;
    drain(il, end_, nullptr);
    stage_of(il).synchronize();
    for (int64_t c = first; c < c_end_; ++c) {
        const uint8_t * layer = blocks_[c] >= 0 ? bounce_buf_->data() + bounce_slot_[c] * lcb_ : s_.kv_->image_layer(c, lk.pl);
        if (blocks_[c] >= 0) s_.kv_->set_layer_async(blocks_[c], lk.pl, layer);
        if (s_.summaries_ && !lk.mtp && (c + 1) * C_ <= end_) s_.summaries_->seal_layer(c, lk.pl, s_.kv_->layout(), layer);   // K first
    }
    s_.timings_.t_prefill_io_ms += ms_since(t_io);
}

// No new position is complete before its last layer is written: forget them all, and put the rings and the
// recurrent state back where they stood.
void Session::ExactPrefillPass::roll_back() {
    hidden_->synchronize_copies();
    s_.kv_->synchronize();
    for (size_t i = 0; i < saved_.size(); ++i) s_.memories_[i]->roll_back(*saved_[i]);
    s_.truncate(start_);
}

size_t Session::ExactPrefillPass::layer_end(int il) const {
    size_t k = k_;
    while (k < steps_.size() && steps_[k].layer == il) ++k;
    return k;
}

bool Session::ExactPrefillPass::advance(int64_t max_steps) {
    try {
        if (!begun_) {
            if (s_.recurrent_) s_.recurrent_->place_step(start_, n_);   // every recurrent layer consumes the prompt in turn
            blocks_ = s_.pager_->chunk_blocks();   // the held chunks' places before the prompt is placed
            begun_ = true;
        }
        for (int64_t ran = 0; il_ < n_stack_;) {
            if (!layer_open_) {
                auto t_io = std::chrono::steady_clock::now();
                stage_layer(il_);
                s_.timings_.t_prefill_io_ms += ms_since(t_io);
                drained_ = c_new_;
                drain_per_step_ = drains_per_step(il_);
                reserve_layer(il_, layer_end(il_));
                layer_open_ = true;
            }
            for (const size_t k_end = layer_end(il_); k_ < k_end; ++k_, ++ran) {
                if (max_steps > 0 && ran == max_steps) return false;
                run_step(k_);
            }
            if (il_ == 0) {
                s_.kv_->add_slabs(slabs_.get());
                s_.place_prompt(tokens_, n_, start_);
                blocks_ = s_.pager_->chunk_blocks();   // every chunk's final place
                bounce_slot_.assign(blocks_.size(), -1);
                for (int64_t c = c_new_, n_bounced = 0; c < c_end_; ++c) {
                    if (blocks_[c] >= 0) bounce_slot_[c] = n_bounced++;
                }
            }
            write_back(il_);
            layer_open_ = false;
            ++il_;
            if (between_) between_();
        }
        hidden_->synchronize_copies();   // the last layers' drains: images and blocks complete before anyone reads them
        s_.kv_->synchronize();
        return true;
    } catch (...) {
        roll_back();
        throw;
    }
}

ExactPrefill Session::ExactPrefillPass::finish() {
    if (il_ < n_stack_) throw std::logic_error("ExactPrefillPass::finish: steps are left");
    account();
    return std::move(out_);
}

void Session::ExactPrefillPass::account() {
    s_.timings_.t_compute_ms += ms_since(t0_);
    if (checkpoint_at_ >= 0) s_.recurrent_->add_checkpoint(std::move(checkpoint_));
    s_.held_queries_ = std::move(queries_);
    s_.queries_dropped_ = false;
    s_.prefill_coverage_ = std::move(coverage_);
    int64_t band_bytes = 0, staging_bytes = 0;
    for (const auto & b : bands_) band_bytes += b->device_bytes();
    for (const auto & ix : sparse_index_) band_bytes += ix ? ix->device_bytes() : 0;
    for (const auto & st : stages_) staging_bytes += st ? st->device_bytes() : 0;
    const int64_t workspace = staging_bytes + band_bytes + hidden_->device_bytes() + peak_compute_ + s_.mtp_compute_bytes();
    if (workspace > s_.prefill_peak_bytes_) {
        s_.prefill_peak_bytes_ = workspace;
        s_.prefill_staging_bytes_ = staging_bytes;
    }
    const size_t own_rows = hidden_->own_rows() ? hidden_->host().size() : 0;   // kept rows: prefill_rows_bytes
    s_.prefill_host_bytes_ = std::max(s_.prefill_host_bytes_, (int64_t) (own_rows + bounce_buf_->size()));
}

ExactPrefill Session::prefill_exact(const int32_t * tokens, int64_t n, int64_t start, const ExactPrefillOptions & options,
                                    const std::function<void()> & between) {
    const SessionLock held = lock();   // the whole prefill: another thread's call waits instead of meeting the run
    const std::unique_ptr<ExactPrefillRun> run = begin_prefill_exact(tokens, n, start, options, between);
    run->advance(0);
    return run->finish();
}

Session::ExactPrefillRun::ExactPrefillRun(Session & s, const int32_t * tokens, int64_t n, int64_t start,
                                          const ExactPrefillOptions & options, std::function<void()> between)
    : s_(s), tokens_(tokens, tokens + n), between_(std::move(between)) {
    s_.release_step_buffer();
    pass_ = std::make_unique<ExactPrefillPass>(s, tokens_.data(), n, start, options, between_);
    s_.open_run_ = this;
}

Session::ExactPrefillRun::~ExactPrefillRun() {
    try {
        close();
    } catch (...) {   // a destructor must not throw; close() itself only fails on a lost device
    }
}

namespace {

// The open run's own calls pass SessionLock's check (set under the session's mutex, which the caller holds).
struct InRun {
    bool & flag;
    explicit InRun(bool & f) : flag(f) { flag = true; }
    ~InRun() { flag = false; }
};

}  // namespace

bool Session::ExactPrefillRun::advance(int64_t max_steps) {
    if (max_steps < 0) throw std::invalid_argument("ExactPrefillRun.advance: max_steps must be >= 0 (0: the rest)");
    const SessionLock held = s_.lock(true, true);
    if (!pass_) throw std::runtime_error("ExactPrefillRun.advance: the run is closed");
    if (done_) return true;
    const InRun in(s_.in_run_);
    try {
        done_ = pass_->advance(max_steps);
    } catch (...) {   // rolled back: the run is over
        pass_.reset();
        s_.open_run_ = nullptr;
        throw;
    }
    return done_;
}

ExactPrefill Session::ExactPrefillRun::finish() {
    const SessionLock held = s_.lock(true, true);
    if (!pass_ || !done_) throw std::runtime_error("ExactPrefillRun.finish: the run is closed or has steps left");
    const InRun in(s_.in_run_);
    ExactPrefill out = pass_->finish();
    pass_.reset();
    s_.open_run_ = nullptr;
    return out;
}

void Session::ExactPrefillRun::close() {
    const SessionLock held = s_.lock(true, true);
    if (!pass_) return;
    const InRun in(s_.in_run_);
    std::unique_ptr<ExactPrefillPass> pass = std::move(pass_);
    s_.open_run_ = nullptr;
    if (!done_) pass->roll_back();
}

int64_t Session::ExactPrefillRun::n_steps() const {
    const SessionLock held = s_.lock(false, true);
    return pass_ ? (int64_t) pass_->n_steps() : 0;
}

int64_t Session::ExactPrefillRun::steps_run() const {
    const SessionLock held = s_.lock(false, true);
    return pass_ ? (int64_t) pass_->steps_run() : 0;
}

std::unique_ptr<Session::ExactPrefillRun> Session::begin_prefill_exact(const int32_t * tokens, int64_t n, int64_t start,
                                                                       ExactPrefillOptions o, std::function<void()> between) {
    const SessionLock held = lock();
    check_tokens(tokens, n, start);
    if (o.n_batch < 0) throw std::invalid_argument("prefill_exact: n_batch must be >= 0 (0: the session's)");
    if (o.n_batch == 0) o.n_batch = cfg_.n_batch;
    if (o.attention_block_bytes < 0) throw std::invalid_argument("prefill_exact: attention_block_bytes must be >= 0");
    if (o.blocks_per_call < 0) throw std::invalid_argument("prefill_exact: blocks_per_call must be >= 0 (0: auto)");
    if (o.ffn_part_rows < 0) throw std::invalid_argument("prefill_exact: ffn_part_rows must be >= 0 (0: 1024)");
    o.sparse.check(cfg_.chunk_tokens);
    if (o.sparse.on() && !flash_attn_) throw std::invalid_argument("sparse prefill: needs flash attention (flash_attn=True)");
    return std::unique_ptr<ExactPrefillRun>(new ExactPrefillRun(*this, tokens, n, start, o, std::move(between)));
}

}  // namespace kvf
