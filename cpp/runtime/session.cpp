#include "runtime/session.h"

#include "model/mtp.h"
#include "model/rpc.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <stdexcept>

namespace kvf {

namespace {

constexpr int64_t k_kv_pad = 256;   // CUDA FA prefers n_kv % 256 == 0; also bounds graph rebuilds
// mul_mat attention on the CPU pays for every attended slot, masked or not (flash attention skips
// masked ones): attend in chunk steps there, one graph rebuild per 64 tokens while the context grows.
// Masked slots add exact zeros to its sums, so this padding changes no result.
constexpr int64_t k_kv_pad_cpu_matmul = 64;
// A step on the CPU that computes every row's logits and has at most this many tokens (a speculative verify step:
// the pending token and its drafts, at most 31 on the CPU: speculative.py CPU_VERIFY_TOKENS) attends with
// one-token steps' kernels (GraphCtx::one_token_kernels), so its rows are bit for bit one-token steps' and greedy
// speculation keeps plain greedy decoding's tokens. Other steps keep ggml's several-query kernels: prompt steps
// (the exact prefill's layer-major steps run those too, and write a full cache's bytes), and every-row steps of a
// prompt's size (libllama's, the reference they are compared with, are those: 64-token steps differed by 1.9
// in a SmolLM2 logit between the two).
constexpr int64_t k_one_token_kernels_max_tokens = 32;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

double ms_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

bool choose_flash_attn(const std::string & attention, bool on_gpu, ggml_type type_v) {
    const bool v_quantized = ggml_is_quantized(type_v);
    if (attention == "flash") return true;
    if (attention == "matmul") {
        if (v_quantized) {
            throw std::invalid_argument(std::string("attention='matmul' needs an unquantized V cache; kv_type ") +
                                        ggml_type_name(type_v) + " works only with attention='flash' or 'auto'");
        }
        return false;
    }
    if (attention != "auto") {
        throw std::invalid_argument("unknown attention '" + attention + "' (expected auto, flash or matmul)");
    }
    // On CPU the mul_mat + soft_max path is ~2-3x faster at depth (docs/DESIGN.md, section "Measured facts").
    return on_gpu || v_quantized;
}

// Attention capture reads the softmaxed probabilities, which only the mul_mat path materialises:
// "auto" may pick it, "flash" or a quantized V cannot.
void check_capture_path(const std::string & attention, ggml_type type_v) {
    if (ggml_is_quantized(type_v) || attention == "flash") {
        throw std::invalid_argument("capture_attention needs the mul_mat attention path: use attention='matmul' or "
                                    "'auto' (and an unquantized V cache), not '" + attention + "'");
    }
}

uint64_t next_serial() {
    static std::atomic<uint64_t> n{0};
    return ++n;
}

}  // namespace

Session::Session(std::shared_ptr<Model> model, const SessionConfig & cfg, std::shared_ptr<PoolArena> arena)
    : model_(std::move(model)), cfg_(cfg), serial_(next_serial()) {
    const ModelHparams & hp = model_->hparams();
    if (cfg_.max_tokens <= 0) throw std::invalid_argument("max_tokens must be positive");
    // Positions are int32 in the graph; the pool size below multiplies the chunk geometry.
    for (int64_t v : {cfg_.max_tokens, cfg_.chunk_tokens, cfg_.sink_chunks, cfg_.tail_chunks}) {
        if (v > INT32_MAX) {
            throw std::invalid_argument("max_tokens, chunk_tokens, sink_chunks and tail_chunks must be at most "
                                        "2147483647 (got " + std::to_string(v) + ")");
        }
    }
    if (cfg_.max_tokens > hp.n_ctx_train && !cfg_.allow_beyond_train_ctx) {
        throw std::invalid_argument("max_tokens=" + std::to_string(cfg_.max_tokens) + " exceeds the model's trained context " +
                                    std::to_string(hp.n_ctx_train) + " (pass allow_beyond_train_ctx to override)");
    }
    if (cfg_.n_batch <= 0) throw std::invalid_argument("n_batch must be positive");
    if (cfg_.pool_tokens < 0) throw std::invalid_argument("pool_tokens must be >= 0 (0 = full cache)");
    model_->check_rpc_connections();   // before allocating on a lost RPC device

    PagerConfig pc;
    pc.chunk_tokens = cfg_.chunk_tokens;
    pc.sink_chunks = cfg_.sink_chunks;
    pc.tail_chunks = cfg_.tail_chunks;
    pc.max_tokens = cfg_.max_tokens;
    full_cache_ = cfg_.pool_tokens == 0;
    // Full cache: a pool that holds the whole context, so the mapping never leaves identity.
    pc.pool_tokens = full_cache_ ? std::max(round_up(cfg_.max_tokens, k_kv_pad), pc.min_pool_tokens())
                                 : cfg_.pool_tokens;

    if (cfg_.mtp) check_mtp(*model_);
    KvLayout layout;
    // Sliding-window layers keep their own ring, linear-attention ones a state; the MTP head's K/V come last.
    layout.n_layer = hp.n_pooled_layers() + (cfg_.mtp ? 1 : 0);
    layout.n_embd_k = hp.n_embd_k();
    layout.n_embd_v = hp.n_embd_v();
    layout.chunk_tokens = cfg_.chunk_tokens;
    layout.pool_tokens = pc.pool_tokens;
    layout.type_k = layout.type_v = kv_type_from_name(cfg_.kv_type);
    flash_attn_ = choose_flash_attn(cfg_.attention, model_->on_gpu(), layout.type_v);
    if (cfg_.capture_attention) {
        check_capture_path(cfg_.attention, layout.type_v);
        flash_attn_ = false;
    }
    ordered_ = cfg_.ordered_attention > 0;
    kv_pad_ = model_->on_gpu() || flash_attn_ ? k_kv_pad : k_kv_pad_cpu_matmul;
    layout.v_trans = v_trans_for(flash_attn_, ordered_);

    pc.validate();
    // Each layer's K/V or state on its layer's device (a split model's; Model::device_of), the MTP head's with the
    // output layer's.
    LayerBackends pooled_on, ring_on, recurrent_on;
    for (int64_t il = 0; il < hp.n_layer; ++il) {
        if (!hp.has_kv(il)) continue;
        (hp.is_pooled(il) ? pooled_on : hp.is_swa(il) ? ring_on : recurrent_on).push_back(model_->layer_backend(il));
    }
    if (cfg_.mtp) pooled_on.push_back(model_->backend());
    kv_ = arena ? std::make_unique<PooledKV>(pooled_on, layout, arena) : std::make_unique<PooledKV>(pooled_on, layout);
    if (hp.n_swa_layers() > 0) {
        KvLayout rl = layout;
        rl.n_layer = hp.n_swa_layers();
        rl.n_embd_k = hp.n_embd_k_swa();   // gemma4's local heads are narrower than its global ones
        rl.n_embd_v = hp.n_embd_v_swa();
        rl.pool_tokens = SlidingWindowKV::ring_tokens_for(hp.n_swa, cfg_.n_batch, kv_pad_, cfg_.chunk_tokens);
        ring_ = std::make_unique<SlidingWindowKV>(ring_on, rl, hp.n_swa, kv_pad_);
    }
    if (hp.n_recurrent_layers() > 0) {
        const int64_t carry = cfg_.mtp ? hp.n_embd : 0;
        recurrent_ = arena ? std::make_unique<RecurrentState>(recurrent_on, hp.n_recurrent_layers(), hp.ssm_conv_state(),
                                                              hp.ssm_recurrent_state(), carry, model_->backend(),
                                                              std::move(arena), kv_->lane())
                           : std::make_unique<RecurrentState>(recurrent_on, hp.n_recurrent_layers(), hp.ssm_conv_state(),
                                                              hp.ssm_recurrent_state(), carry, model_->backend());
    }
    if (ring_) memories_.push_back(ring_.get());
    if (recurrent_) memories_.push_back(recurrent_.get());
    if (cfg_.mtp) mtp_ = new_mtp_drafts();
    pc.chunk_bytes = kv_->chunk_bytes();
    pager_ = std::make_unique<KvPager>(pc);
    if (cfg_.track_summaries) {
        summaries_ = std::make_unique<ChunkSummaries>(SummaryShape{hp.n_pooled_layers(), hp.n_head_kv, hp.head_dim_k});
    }

    sched_ = new_sched();
}

size_t Session::graph_size() const {
    // ggml's scheduler hashes a graph's nodes and leafs (the weights, the state tensors) in a set of this size: a
    // qwen35 linear-attention layer has ~55 nodes and ~15 leafs, and 64 a layer overflowed the Qwen3.5-27B shape's
    // 64 layers once the recurrent state became arena lanes (a view node each). A step that attends one query at a
    // time (GraphCtx::one_token_kernels on the flash path) adds about 8 nodes per query and layer.
    const size_t per_layer = 128 + (model_->on_gpu() ? 0 : 8 * (size_t) k_one_token_kernels_max_tokens);
    return std::max<size_t>(4096, (size_t) model_->hparams().n_layer * per_layer);
}

ggml_backend_sched_t Session::new_sched(size_t n_nodes) const {
    if (n_nodes == 0) n_nodes = graph_size();
    // Every device of the model's split, then the CPU (ggml's scheduler wants it last: its fallback). The step
    // inputs (tokens, positions, slots, mask) live in the CPU backend's buffer and are copied to each device
    // every step: from pinned memory where a GPU offers it, as llama.cpp does, those copies are DMA.
    std::vector<ggml_backend_t> backends;
    std::vector<ggml_backend_buffer_type_t> bufts;
    ggml_backend_buffer_type_t host = nullptr;
    for (int d = 0; d < model_->n_devices(); ++d) {
        ggml_backend_t b = model_->device_backend(d);
        if (b == model_->cpu_backend()) continue;
        backends.push_back(b);
        bufts.push_back(ggml_backend_get_default_buffer_type(b));
        if (!host) host = ggml_backend_dev_host_buffer_type(ggml_backend_get_device(b));
    }
    backends.push_back(model_->cpu_backend());
    bufts.push_back(host ? host : ggml_backend_get_default_buffer_type(model_->cpu_backend()));
    ggml_backend_sched_t sched =
        ggml_backend_sched_new(backends.data(), bufts.data(), (int) backends.size(), n_nodes, false, true);
    if (!sched) throw std::runtime_error("could not create the ggml scheduler");
    return sched;
}

void Session::check_tokens(const int32_t * tokens, int64_t n, int64_t start) const {
    if (n <= 0) throw std::invalid_argument("forward needs at least one token");
    if (start != pager_->n_tokens()) {
        throw std::invalid_argument("forward start=" + std::to_string(start) + " but the session holds " +
                                    std::to_string(pager_->n_tokens()) + " tokens (truncate first to rewrite)");
    }
    if (start + n > cfg_.max_tokens) {
        throw std::invalid_argument("forward of " + std::to_string(n) + " tokens at " + std::to_string(start) +
                                    " exceeds max_tokens=" + std::to_string(cfg_.max_tokens));
    }
    const int64_t n_vocab = model_->hparams().n_vocab;
    for (int64_t i = 0; i < n; ++i) {
        if (tokens[i] < 0 || tokens[i] >= n_vocab) {
            throw std::invalid_argument("token id " + std::to_string(tokens[i]) + " outside the vocabulary [0, " +
                                        std::to_string(n_vocab) + ")");
        }
    }
}

Session::~Session() {
    if (logits_host_) ggml_backend_buffer_free(logits_host_);
    if (sched_) ggml_backend_sched_free(sched_);
    if (graph_ctx_) ggml_free(graph_ctx_);
}

void Session::release_step_buffer() {
    ggml_backend_sched_free(sched_);
    sched_ = new_sched();
    shape_[0] = -1;   // the graph's tensors lived in that buffer: the next step builds and allocates anew
}

void Session::execute(const Plan & plan) {
    const auto t0 = std::chrono::steady_clock::now();
    kv_->execute(plan);
    pager_->apply(plan);
    if (plan.moves_bytes()) timings_.t_paging_ms += ms_since(t0);
}

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

SessionLock Session::lock(bool device, bool during_run) const {
    SessionLock held;
    held.session = std::unique_lock<std::recursive_mutex>(mutex_);
    if (open_run_ && !in_run_ && !during_run) {
        throw std::runtime_error("the session is in the middle of an exact prefill (an open ExactPrefillRun): "
                                 "finish or close it first");
    }
    if (device) held.device = std::unique_lock<std::recursive_mutex>(model_->compute_mutex());
    return held;
}

int64_t Session::n_tokens() const {
    const SessionLock held = lock(false);
    return pager_->n_tokens();
}

SessionTimings Session::timings() const {
    const SessionLock held = lock(false, true);
    return timings_;
}

std::vector<float> Session::prefill_coverage() const {
    const SessionLock held = lock(false, true);
    return prefill_coverage_;
}

std::vector<float> Session::forward(const int32_t * tokens, int64_t n, int64_t start, bool all_logits) {
    const SessionLock held = lock();
    std::vector<float> logits((size_t) (all_logits ? std::max<int64_t>(n, 0) : 1) * model_->hparams().n_vocab);
    run(tokens, n, start, all_logits, logits.data(), nullptr);
    return logits;
}

int32_t Session::forward_greedy(const int32_t * tokens, int64_t n, int64_t start) {
    const SessionLock held = lock();
    int32_t token = -1;
    run(tokens, n, start, false, nullptr, &token);
    return token;
}

void Session::run(const int32_t * tokens, int64_t n, int64_t start, bool all_logits, float * logits, int32_t * greedy) {
    check_tokens(tokens, n, start);
    const int64_t n_vocab = model_->hparams().n_vocab;
    for (int64_t done = 0; done < n;) {
        const int64_t step = step_tokens(n - done);
        const PlacedStep placed = place_step(step);
        const bool last = done + step == n;
        float * out = logits && (all_logits || last) ? logits + (all_logits ? (size_t) done * n_vocab : 0) : nullptr;
        const auto t0 = std::chrono::steady_clock::now();
        try {
            compute(tokens + done, placed, all_logits, out, last ? greedy : nullptr);
        } catch (...) {
            unplace_step(placed);
            throw;
        }
        finish_step(placed, tokens + done, ms_since(t0), StepQueries{});   // queries() reads the step's graph
        done += step;
    }
}

void Session::compute(const int32_t * tokens, const PlacedStep & step, bool all_logits, float * logits_out,
                      int32_t * greedy_out) {
    const int64_t n = step.n;
    const KvKeyOrder & order = step.order;
    const int64_t n_outputs = all_logits ? n : 1, n_ring_kv = ring_ ? ring_->step_order().n_kv : 0;
    if (shape_[0] != n || shape_[1] != order.n_kv || shape_[2] != n_outputs || shape_[3] != order.gathered ||
        shape_[4] != n_ring_kv) {
        build_graph(n, order.n_kv, n_outputs, order.gathered, n_ring_kv);
    }
    set_inputs(tokens, n, step.plan, n_outputs, order);
    if (held_queries_.n_layer > 0) held_queries_ = StepQueries{};   // queries() reads this step's from now on
    queries_dropped_ = false;
    if (cfg_.capture_attention) keep_capture_order(order);
    if (ggml_backend_sched_graph_compute(sched_, graph_.gf) != GGML_STATUS_SUCCESS) {
        throw std::runtime_error("ggml graph compute failed");
    }
    if (logits_out) read_logits(logits_out);
    if (greedy_out) *greedy_out = read_greedy();
}

void Session::build_graph(int64_t n_tokens, int64_t n_kv, int64_t n_outputs, bool gathered, int64_t n_ring_kv) {
    if (graph_ctx_) ggml_free(graph_ctx_);
    graph_ctx_ = new_graph_ctx();
    graph_ = GraphCtx{};
    GraphCtx & g = graph_;
    g.ctx = graph_ctx_;
    g.gf = ggml_new_graph_custom(graph_ctx_, graph_size(), false);
    g.kv = kv_.get();
    g.n_tokens = n_tokens;
    g.n_kv = n_kv;
    g.n_outputs = n_outputs;
    g.flash_attn = flash_attn_;
    g.one_token_kernels = !model_->on_gpu() && n_outputs == n_tokens && n_tokens > 1 &&
                          n_tokens <= k_one_token_kernels_max_tokens;
    // Queries are captured only for sessions whose scorers read them: on CUDA the capture is 32 more
    // kernels and outputs per 8B decode step (~2% of it), for nothing under lru.
    g.n_query_tokens = cfg_.track_summaries ? std::min(n_tokens, k_capture_tokens) : 0;
    g.n_attn_tokens = cfg_.capture_attention ? std::min(n_tokens, k_capture_tokens) : 0;

    g.in.tokens = ggml_new_tensor_1d(g.ctx, GGML_TYPE_I32, n_tokens);
    g.in.positions = ggml_new_tensor_1d(g.ctx, GGML_TYPE_I32, n_tokens);
    g.in.out_ids = n_outputs < n_tokens ? ggml_new_tensor_1d(g.ctx, GGML_TYPE_I32, n_outputs) : nullptr;
    for (ggml_tensor * t : {g.in.tokens, g.in.positions, g.in.out_ids}) {
        if (t) ggml_set_input(t);
    }
    g.in.kv = kv_step_inputs_new(g.ctx, kv_->layout(), n_tokens, n_kv, gathered);
    g.recurrent = recurrent_.get();
    if (ring_) {
        g.ring = &ring_->kv();
        g.n_ring_kv = n_ring_kv;
        g.ring_in = kv_step_inputs_new(g.ctx, ring_->kv().layout(), n_tokens, n_ring_kv, false);
    }

    const Model & m = *model_;
    if (cfg_.mtp) {   // the head reads the trunk's every row and writes the last pooled layer
        g.all_rows = true;
        g.mtp_kv_layer = kv_->layout().n_layer - 1;
    }
    ggml_tensor * h = build_stack(g, m);
    if (cfg_.mtp) h = build_mtp_follow(g, m, h);
    logits_ = build_logits(g, m, h);   // [n_vocab, n_outputs]
    greedy_ = {};
    if (n_outputs == 1) build_greedy(g);   // prefill graphs with every row's logits skip it

    ggml_backend_sched_reset(sched_);
    pin_layer_boundaries(sched_, g, m);
    if (!ggml_backend_sched_alloc_graph(sched_, g.gf)) {
        shape_[0] = -1;
        check_rpc_connections(sched_);   // a lost RPC device allocates nothing: say so, not "out of memory"
        throw std::runtime_error("could not allocate the compute graph (out of memory?)");
    }
    shape_[0] = n_tokens;
    shape_[1] = n_kv;
    shape_[2] = n_outputs;
    shape_[3] = gathered;
    shape_[4] = n_ring_kv;
    timings_.n_graph_builds++;
}

ggml_context * Session::new_graph_ctx(size_t n_nodes) const {
    const size_t n = n_nodes ? n_nodes : graph_size();
    ggml_init_params params = {ggml_tensor_overhead() * n + ggml_graph_overhead_custom(n, false), nullptr, true};
    ggml_context * ctx = ggml_init(params);
    if (!ctx) throw std::runtime_error("could not create a graph context");
    return ctx;
}

void Session::set_inputs(const int32_t * tokens, int64_t n, const Plan & alloc, int64_t n_outputs, const KvKeyOrder & order) {
    const StepInputs & in = graph_.in;
    std::vector<int32_t> pos(n);
    for (int64_t i = 0; i < n; ++i) pos[i] = (int32_t) (alloc.span_start + i);
    ggml_backend_tensor_set(in.tokens, tokens, 0, n * sizeof(int32_t));
    ggml_backend_tensor_set(in.positions, pos.data(), 0, n * sizeof(int32_t));
    kv_step_inputs_set(in.kv, kv_->layout(), order, alloc, pos.data(), input_scratch_);
    if (ring_) {
        kv_step_inputs_set(graph_.ring_in, ring_->kv().layout(), ring_->step_order(), ring_->step_plan(), pos.data(), ring_scratch_);
    }
    if (in.out_ids) {
        std::vector<int32_t> ids(n_outputs);
        for (int64_t i = 0; i < n_outputs; ++i) ids[i] = (int32_t) (n - n_outputs + i);
        ggml_backend_tensor_set(in.out_ids, ids.data(), 0, n_outputs * sizeof(int32_t));
    }
}

int64_t Session::shared_prefix(const int32_t * tokens, int64_t n, int64_t start) const {
    const SessionLock held = lock(false);
    const int64_t n_held = (int64_t) tokens_.size();
    if (start < 0 || start > n_held || n < 0) {
        throw std::invalid_argument("shared_prefix: start=" + std::to_string(start) + " and " + std::to_string(n) +
                                    " tokens; start must be in [0, n_tokens()=" + std::to_string(n_held) + "]");
    }
    const int64_t m = std::min(n, n_held - start);
    const auto first = tokens_.begin() + start;
    return start + (int64_t) (std::mismatch(first, first + m, tokens).first - first);
}

bool Session::can_truncate(int64_t n) const {
    const SessionLock held = lock(false);
    if (n < 0 || n > pager_->n_tokens()) return false;
    for (const ContextMemory * m : memories_) if (!m->can_truncate(n)) return false;
    return true;
}

int64_t Session::rewind_point(int64_t n) const {
    const SessionLock held = lock(false);
    n = std::clamp<int64_t>(n, 0, pager_->n_tokens());
    // Each memory lowers n to the latest point at or before it that it reaches. A ring that reaches a point reaches
    // every later one, so what is left is the latest point all of them reach (the check is the guard for a memory
    // without that property).
    for (const ContextMemory * m : memories_) n = std::min(n, m->rewind_point(n));
    return can_truncate(n) ? n : 0;
}

void Session::checkpoint() {
    const SessionLock held = lock();
    if (recurrent_) recurrent_->checkpoint();
}

void Session::stash() {
    const SessionLock held = lock();
    if (recurrent_) recurrent_->stash();
}

void Session::mark_unchanged() {
    const SessionLock held = lock();
    n_unchanged_ = n_tokens();
}

int64_t Session::n_unchanged() const {
    const SessionLock held = lock(false);
    return n_unchanged_;
}

void Session::truncate(int64_t n) {
    const SessionLock held = lock();
    if (n >= 0 && n <= pager_->n_tokens()) {
        // Each throws, changing nothing, if it cannot: asked first, so that none has moved when one refuses.
        for (ContextMemory * m : memories_) if (!m->can_truncate(n)) m->truncate(n);
        for (ContextMemory * m : memories_) m->truncate(n);
    }
    execute(pager_->plan_truncate(n));
    tokens_.resize((size_t) n);
    n_unchanged_ = std::min(n_unchanged_, n);
    if (summaries_) summaries_->forget_from(n / cfg_.chunk_tokens);   // a chunk cut short is no longer sealed
}

void Session::adopt(const Session & src, int64_t n) {
    // Both sessions at once (std::lock backs off instead of deadlocking when another thread adopts the
    // other way round), then both models' compute. Recursive mutexes: src may be this session or share
    // its model, and locking a mutex this thread holds again is fine.
    std::scoped_lock sessions(mutex_, src.mutex_);
    std::scoped_lock devices(model_->compute_mutex(), src.model_->compute_mutex());
    const int64_t C = cfg_.chunk_tokens, start = n_tokens();
    if (!memories_.empty()) {
        throw std::invalid_argument("adopt: it copies pooled chunks; a model's sliding-window rings or linear-attention "
                                    "state cannot be adopted");
    }
    const KvLayout & a = kv_->layout(), & b = src.kv().layout();
    if (model_->fingerprint() != src.model().fingerprint()) {
        throw std::invalid_argument("adopt: the source session runs another model");
    }
    if (a.n_layer != b.n_layer || a.n_embd_k != b.n_embd_k || a.n_embd_v != b.n_embd_v || a.type_k != b.type_k ||
        a.type_v != b.type_v || a.chunk_tokens != b.chunk_tokens) {
        throw std::invalid_argument("adopt: the source session lays K/V out differently (kv_type or chunk_tokens)");
    }
    if (start % C != 0) {
        throw std::invalid_argument("adopt: this session holds " + std::to_string(start) +
                                    " tokens, not a chunk boundary (truncate to a multiple of " + std::to_string(C) + ")");
    }
    if (n < start || n > src.n_tokens() || n > cfg_.max_tokens) {
        throw std::invalid_argument("adopt: cannot take positions [" + std::to_string(start) + ", " + std::to_string(n) +
                                    ") from a session holding " + std::to_string(src.n_tokens()) + " tokens into max_tokens=" +
                                    std::to_string(cfg_.max_tokens));
    }
    if ((int64_t) tokens_.size() != start || (int64_t) src.tokens().size() != src.n_tokens()) {
        throw std::logic_error("adopt: a session's tokens are out of step with its pager");
    }
    if (!std::equal(tokens_.begin(), tokens_.end(), src.tokens().begin())) {
        throw std::invalid_argument("adopt: the source session holds other tokens before position " + std::to_string(start));
    }
    for (int64_t p = start; p < n; p += C) {
        const int64_t c = p / C, step = std::min(C, n - p);
        execute(pager_->plan_alloc(p, step));
        const int64_t src_block = src.pager().is_resident(c) ? src.pager().slot_of(p) / C : -1;
        kv_->write_block_rows(pager_->slot_of(p) / C, src.kv().chunk_rows(c, src_block));
        tokens_.insert(tokens_.end(), src.tokens().begin() + p, src.tokens().begin() + p + step);
        seal_chunks(p, step);
    }
}

void Session::check_step(const int32_t * tokens, int64_t n) const {
    const SessionLock held = lock(false);
    check_tokens(tokens, n, pager_->n_tokens());
    const auto too_long = [n](const ContextMemory * m) { return n > m->max_step(); };
    if (n > 1 && (n > pager_->max_span_tokens(n) || std::any_of(memories_.begin(), memories_.end(), too_long))) {
        throw std::invalid_argument("the pool cannot place " + std::to_string(n) + " tokens at once");
    }
}

Session::PlacedStep Session::place_step(int64_t n) {
    const SessionLock held = lock(false);
    PlacedStep step;
    step.start = pager_->n_tokens();
    step.n = n;
    step.plan = pager_->plan_alloc(step.start, n);
    execute(step.plan);
    try {
        step.order = kv_key_order(*pager_, kv_->layout(), ordered_, kv_pad_);
        for (ContextMemory * m : memories_) {
            m->place_step(step.start, n);
            ++step.n_memories;
        }
    } catch (...) {
        unplace_step(step);
        throw;
    }
    return step;
}

void Session::unplace_step(const PlacedStep & step) {
    const SessionLock held = lock(false);
    execute(pager_->plan_truncate(step.start));
    // Exact before the graph computes (no byte has moved; the ring rows a failed step may have written held positions
    // no window reaches any more); BatchDecoder's header says what a compute that fails midway leaves.
    for (size_t i = step.n_memories; i-- > 0;) memories_[i]->unplace_step(step.start);
}

void Session::finish_step(const PlacedStep & step, const int32_t * tokens, double compute_ms, StepQueries queries,
                          bool queries_kept) {
    const SessionLock held = lock(false);
    tokens_.insert(tokens_.end(), tokens, tokens + step.n);
    timings_.t_compute_ms += compute_ms;
    timings_.n_computes++;
    if (summaries_) {   // what its own step leaves a scorer: the step's queries, the chunks it completed
        held_queries_ = std::move(queries);
        queries_dropped_ = !queries_kept;
        seal_chunks(step.start, step.n);
    }
}

void Session::seal_chunks(int64_t start, int64_t n) {
    if (!summaries_) return;
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t C = cfg_.chunk_tokens;
    for (int64_t c = start / C; (c + 1) * C <= start + n; ++c) {
        if ((c + 1) * C - 1 < start) continue;   // sealed before this step
        summaries_->seal(c, pager_->slot_of(c * C) / C, *kv_);
    }
    timings_.t_scoring_ms += ms_since(t0);
}

StepQueries Session::queries() const {
    const SessionLock held = lock();
    if (queries_dropped_) {
        throw std::runtime_error("no queries of the latest step: it was a batched step that did not keep this "
                                 "session's (BatchDecoder's keep_queries)");
    }
    if (held_queries_.n_layer > 0) return held_queries_;   // the latest step ran outside graph_
    StepQueries q;
    if (graph_.queries.empty() || shape_[0] < 0) return q;
    const ggml_tensor * t0 = graph_.queries[0];   // [head_dim, n_head, n_q]
    q.n_layer = (int64_t) graph_.queries.size();
    q.head_dim = t0->ne[0];
    q.n_head = t0->ne[1];
    q.n_tokens = t0->ne[2];
    q.data.resize((size_t) (q.n_layer * q.n_tokens * q.n_head * q.head_dim));
    for (int64_t il = 0; il < q.n_layer; ++il) {
        ggml_backend_tensor_get(graph_.queries[il], q.data.data() + il * ggml_nelements(t0), 0, ggml_nbytes(t0));
    }
    return q;
}

std::vector<float> Session::chunk_scores(const std::string & kind) {
    const SessionLock held = lock();
    if (!summaries_) throw std::logic_error("chunk_scores needs a session made with track_summaries=True");
    return summaries_->scores(kind, queries(), pager_->n_chunks());
}

void Session::reselect(const std::vector<float> & scores) {
    const SessionLock held = lock();
    execute(pager_->plan_reselect(scores));
}

int64_t Session::step_tokens(int64_t n_remaining) const {
    const SessionLock held = lock(false);
    if (n_remaining <= 0) throw std::invalid_argument("step_tokens needs n_remaining >= 1");
    // Each step must fit the pool at once: the pager says how much it can place.
    const int64_t want = std::min({n_remaining, cfg_.n_batch, ring_ ? ring_->max_step() : INT64_MAX});
    int64_t step = std::min(want, pager_->max_span_tokens(want));
    if (step <= 0) throw std::runtime_error("the pool has no room for another token (pins too large?)");
    const int64_t n_last = std::min(n_remaining, k_capture_tokens);
    const bool captures = cfg_.track_summaries || cfg_.capture_attention;
    // A shorter step now leaves the last n_last tokens for one step (it fits: fewer than this one).
    if (captures && step < n_remaining && n_remaining - step < n_last && n_remaining > n_last) {
        step = n_remaining - n_last;
    }
    return step;
}

void Session::pin(int64_t lo, int64_t hi) {
    const SessionLock held = lock();
    execute(pager_->plan_pin(lo, hi));
}

void Session::unpin_all() {
    const SessionLock held = lock(false);
    pager_->unpin_all();
}

int64_t Session::reserve_host(int64_t n_tokens) {
    const SessionLock held = lock();
    if (n_tokens < 0) throw std::invalid_argument("reserve_host: n_tokens must be >= 0");
    // Every chunk of the context: those the pool cannot hold, and those a reselect pages back in, which keep their
    // images (the pager's clean copies). A full cache pages nothing.
    const int64_t C = cfg_.chunk_tokens, n_images = full_cache_ ? 0 : (n_tokens + C - 1) / C;
    kv_->add_slabs(kv_->make_slabs(kv_->host_slots_short(n_images)));
    const size_t rows_bytes = full_cache_ ? 0 : (size_t) n_tokens * (size_t) model_->hparams().n_embd * sizeof(float);
    if (rows_bytes > 0 && (!prefill_rows_ || prefill_rows_->size() < rows_bytes)) {
        prefill_rows_.reset();   // a prefill still running keeps the rows it took
        prefill_rows_ = std::make_shared<HostMemory>(rows_bytes, can_pin_for(model_->backend()));
    }
    return kv_->host_store_bytes();
}

void Session::reset() {
    const SessionLock held = lock();
    pager_->reset();
    kv_->clear_host();
    for (ContextMemory * m : memories_) m->clear();
    tokens_.clear();
    n_unchanged_ = 0;
    held_queries_ = StepQueries{};
    queries_dropped_ = false;
    if (summaries_) summaries_->clear();
}

int64_t sched_device_bytes(const Model & m, ggml_backend_sched_t sched, int device) {
    int64_t n = 0;
    for (int d = 0; d < m.n_devices(); ++d) {
        if (device < 0 || d == device) n += (int64_t) ggml_backend_sched_get_buffer_size(sched, m.device_backend(d));
    }
    return n;
}

SessionMemory Session::memory() const {
    const SessionLock held = lock(false, true);
    SessionMemory mem;
    mem.pool_bytes = kv_->device_bytes();
    mem.ring_bytes = ring_ ? ring_->device_bytes() : 0;
    mem.recurrent_bytes = recurrent_ ? recurrent_->device_bytes() : 0;
    mem.recurrent_checkpoint_bytes = recurrent_ ? recurrent_->checkpoint_bytes() : 0;
    mem.prefill_peak_bytes = prefill_peak_bytes_;
    mem.prefill_staging_bytes = prefill_staging_bytes_;
    mem.prefill_host_bytes = prefill_host_bytes_;
    mem.host_store_bytes = kv_->host_store_bytes();
    mem.prefill_rows_bytes = prefill_rows_ ? (int64_t) prefill_rows_->size() : 0;
    for (int d = 0; d < model_->n_devices(); ++d) {
        ggml_backend_t b = model_->device_backend(d);
        DeviceMemory dm;
        dm.name = ggml_backend_name(b);
        dm.weight_bytes = model_->device_weight_bytes(d);
        dm.pool_bytes = kv_->device_bytes_on(b);
        dm.ring_bytes = ring_ ? ring_->device_bytes_on(b) : 0;
        dm.recurrent_bytes = recurrent_ ? recurrent_->device_bytes_on(b) : 0;
        dm.compute_bytes = sched_device_bytes(*model_, sched_, d) + (b == model_->backend() ? mtp_compute_bytes() : 0);
        mem.devices.push_back(dm);
        mem.compute_bytes += dm.compute_bytes;
    }
    return mem;
}

}  // namespace kvf
