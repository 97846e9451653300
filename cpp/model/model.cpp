#include "model/model.h"

#include "model/backends.h"
#include "model/device_split.h"
#include "model/rpc.h"
#include "model/gguf_meta.h"

#include "gguf.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <thread>

namespace kvf {

namespace {

std::string shape_str(const int64_t * ne, int n) {
    std::ostringstream s;
    s << "[";
    for (int i = 0; i < n; ++i) s << (i ? ", " : "") << ne[i];
    s << "]";
    return s.str();
}

class GgufTensorSource : public TensorSource {
public:
    explicit GgufTensorSource(ggml_context * meta) : meta_(meta) {}
    ggml_tensor * require(const std::string & name, std::vector<int64_t> shape) override {
        ggml_tensor * t = optional(name, shape);
        if (!t) throw std::runtime_error("GGUF is missing the tensor " + name + " " + shape_str(shape.data(), (int) shape.size()));
        return t;
    }
    ggml_tensor * optional(const std::string & name, std::vector<int64_t> shape) override {
        ggml_tensor * t = ggml_get_tensor(meta_, name.c_str());
        if (!t) return nullptr;
        // Norms, biases and rope factors are F32 in every converter's output; matrices are float or
        // quantized. Anything else (integer types, F64) has no mul/mul_mat kernel: ggml would abort.
        const bool ok_type = shape.size() == 1
            ? t->type == GGML_TYPE_F32
            : t->type == GGML_TYPE_F32 || t->type == GGML_TYPE_F16 || t->type == GGML_TYPE_BF16 || ggml_is_quantized(t->type);
        if (!ok_type) {
            throw std::runtime_error("tensor " + name + " has type " + ggml_type_name(t->type) + ", expected " +
                                     (shape.size() == 1 ? "f32" : "a float or quantized type"));
        }
        for (int i = 0; i < GGML_MAX_DIMS; ++i) {
            const int64_t want = i < (int) shape.size() ? shape[i] : 1;
            if (t->ne[i] != want) {
                throw std::runtime_error("tensor " + name + " has shape " + shape_str(t->ne, ggml_n_dims(t)) +
                                         ", expected " + shape_str(shape.data(), (int) shape.size()));
            }
        }
        return t;
    }
    const ggml_tensor * stored(const std::string & name) override { return ggml_get_tensor(meta_, name.c_str()); }
private:
    ggml_context * meta_;
};

ggml_backend_t gpu_backend_init(int index) {
    int seen = 0;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        if (ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_GPU || seen++ != index) continue;
        ggml_backend_t b = ggml_backend_dev_init(dev, nullptr);
        if (!b) throw std::runtime_error(std::string("could not initialise GPU backend ") + ggml_backend_dev_name(dev));
        return b;
    }
    throw std::runtime_error("GPU " + std::to_string(index) + " requested, but " +
                             (seen ? "this host has only " + std::to_string(seen) : std::string("no GPU backend is available")) +
                             " (build with KVFLASH_CUDA=ON on a machine with a GPU)");
}

// The devices asked for, in layer order (ModelOptions): `devices` as given, else llama.cpp's choice.
std::vector<DeviceSpec> wanted_devices(const ModelOptions & o) {
    const std::string & want = o.backend;
    if (want != "auto" && want != "cpu" && want != "cuda" && want != "rpc") {
        throw std::invalid_argument("unknown backend '" + want + "' (expected auto, cpu, cuda or rpc)");
    }
    std::vector<DeviceSpec> specs;
    if (!o.devices.empty()) {
        if (!o.rpc.empty() || want != "auto") {
            throw std::invalid_argument("devices names every device (rpc:HOST:PORT for an RPC server): give it without "
                                        "rpc or backend");
        }
        for (const std::string & d : o.devices) specs.push_back(parse_device(d));
        return specs;
    }
    if (!o.rpc.empty() && want == "cpu") {
        throw std::invalid_argument("rpc endpoints given with backend 'cpu' (use devices=[..., 'cpu'] to split "
                                    "across RPC servers and this CPU)");
    }
    if (want == "rpc" && o.rpc.empty()) throw std::invalid_argument("backend 'rpc' needs an endpoint (rpc=['host:port'])");
    for (const std::string & e : o.rpc) {
        DeviceSpec d;
        d.kind = DeviceSpec::Kind::rpc;
        d.endpoint = e;
        specs.push_back(d);
    }
    const bool has_gpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU) != nullptr;
    if (want == "cuda" || (want == "auto" && has_gpu)) specs.push_back({DeviceSpec::Kind::gpu, 0, ""});
    if (specs.empty()) specs.push_back({});   // the CPU
    return specs;
}

uint64_t hash_bytes(uint64_t h, const uint8_t * p, size_t n) {
    // FNV-1a over 8-byte words: fast enough to hash every weight byte while loading.
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        std::memcpy(&w, p + i, 8);
        h = (h ^ w) * 0x100000001b3ULL;
    }
    for (; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ULL;
    return h;
}

}  // namespace

Model::Model(const std::string & path, const ModelOptions & opts) : path_(path) {
    const std::unique_ptr<GgufFile> file = open_gguf(path, /*with_tensors =*/ true);
    gguf_context * gctx = file->gguf;
    ggml_context * meta = file->tensors;

    read_hparams(gctx);
    check_mtp(opts.mtp);

    cpu_backend_ = cpu_backend_init();   // throws with the reason when no CPU variant loads
    try {
        set_n_threads(opts.n_threads);
        open_devices(opts);
        load_tensors(gctx, meta, opts.mtp);
    } catch (...) {
        free_devices();
        throw;
    }
}

Model::~Model() { free_devices(); }

void Model::free_devices() {
    for (ModelDevice & d : devices_) {
        if (d.buf_w) ggml_backend_buffer_free(d.buf_w);
        if (d.ctx_w) ggml_free(d.ctx_w);
        if (d.backend && !d.is_cpu) ggml_backend_free(d.backend);
    }
    devices_.clear();
    if (cpu_backend_) ggml_backend_free(cpu_backend_);
    cpu_backend_ = nullptr;
}

void Model::open_devices(const ModelOptions & opts) {
    const std::vector<DeviceSpec> specs = wanted_devices(opts);
    if (!opts.tensor_split.empty() && opts.tensor_split.size() != specs.size()) {
        throw std::invalid_argument("tensor_split has " + std::to_string(opts.tensor_split.size()) + " shares for " +
                                    std::to_string(specs.size()) + " devices");
    }
    std::vector<std::string> seen;
    for (const DeviceSpec & s : specs) {
        const std::string key = s.kind == DeviceSpec::Kind::cpu ? "cpu"
                              : s.kind == DeviceSpec::Kind::gpu ? "cuda" + std::to_string(s.index)
                              : parse_rpc_endpoint(s.endpoint).text();
        if (std::find(seen.begin(), seen.end(), key) != seen.end()) {
            throw std::invalid_argument("device " + key + " is named twice");
        }
        seen.push_back(key);
        ModelDevice d;
        if (s.kind == DeviceSpec::Kind::cpu) {
            d.backend = cpu_backend_;
            d.is_cpu = true;
        } else if (s.kind == DeviceSpec::Kind::gpu) {
            d.backend = gpu_backend_init(s.index);
            note_device_baseline(ggml_backend_get_device(d.backend));   // before any weight: see device_bytes_taken
        } else {
            RpcDevice r = rpc_device_init(s.endpoint);
            d.backend = r.backend;
            d.rpc_hold = std::move(r.hold);
            d.is_rpc = true;
        }
        devices_.push_back(std::move(d));
    }
    std::vector<double> shares = opts.tensor_split;
    if (shares.empty()) {   // by free memory, as llama.cpp splits by default
        for (const ModelDevice & d : devices_) {
            size_t free = 0, total = 0;
            ggml_backend_dev_memory(ggml_backend_get_device(d.backend), &free, &total);
            shares.push_back((double) free);
        }
        if (std::all_of(shares.begin(), shares.end(), [](double v) { return v <= 0.0; })) shares.assign(shares.size(), 1.0);
    }
    layer_device_ = split_layers(hp_.n_layer, shares);
}

bool Model::on_gpu() const {
    return std::any_of(devices_.begin(), devices_.end(), [](const ModelDevice & d) { return !d.is_cpu; });
}

bool Model::on_rpc() const {
    return std::any_of(devices_.begin(), devices_.end(), [](const ModelDevice & d) { return d.is_rpc; });
}

void Model::check_mtp(bool want) const {
    const std::string what = "the " + hp_.arch + " family";
    if (want && !arch_->mtp) {
        throw std::invalid_argument("mtp: " + what + " runs no multi-token-prediction (nextn) head");
    }
    if (want && hp_.n_layer_nextn == 0) {
        throw std::invalid_argument("mtp: this GGUF has no multi-token-prediction (nextn) layers (" + hp_.arch +
                                    ".nextn_predict_layers); convert it without --no-mtp");
    }
    if (!want && hp_.n_layer_nextn > 0) {
        ggml_log_callback cb = nullptr;
        void * ud = nullptr;
        ggml_log_get(&cb, &ud);
        const std::string line = "kvflash: " + hp_.arch + ": " + std::to_string(hp_.n_layer_nextn) +
                                 " multi-token-prediction (nextn) layer(s) not loaded (load with mtp to draft with them)\n";
        if (cb) cb(GGML_LOG_LEVEL_WARN, line.c_str(), ud);
    }
}

void Model::set_n_threads(int n) {
    const std::lock_guard<std::recursive_mutex> computing(compute_mutex_);   // the count a compute reads
    n_threads_ = n > 0 ? n : (int) std::max(1u, std::thread::hardware_concurrency());
    set_backend_threads(cpu_backend_, n_threads_);
}

namespace {

// Sizes read from the file: small enough that no product of two overflows int64 before the tensor shapes
// (which must match them, and which gguf checked against the file) are compared.
constexpr int64_t k_max_dim = INT32_MAX;

// A key that may hold one value per layer: the value (layer 0's) in `out`, and the per-layer values in
// `per_layer` only when they differ (empty: the same on every layer). false when the key is absent.
bool read_per_layer(const gguf_context * g, const std::string & key, int64_t n_layer, int64_t & out,
                    std::vector<int64_t> & per_layer) {
    const int64_t id = gguf_find_key(g, key.c_str());
    if (id < 0 || gguf_get_kv_type(g, id) != GGUF_TYPE_ARRAY) return meta_int(g, key, 1, k_max_dim, out);
    meta_int_array(g, key, n_layer, 1, k_max_dim, per_layer);
    out = per_layer[0];
    if (std::all_of(per_layer.begin(), per_layer.end(), [&](int64_t v) { return v == out; })) per_layer.clear();
    return true;
}

}  // namespace

void Model::read_hparams(gguf_context * g) {
    if (!meta_str(g, "general.architecture", hp_.arch)) throw std::runtime_error("GGUF has no general.architecture key");
    arch_ = find_arch(hp_.arch);
    if (!arch_) {
        throw std::runtime_error("unsupported architecture '" + hp_.arch + "' (supported: " + supported_archs() + ")");
    }
    meta_str(g, "general.name", hp_.name);

    const std::string a = hp_.arch + ".";
    hp_.n_layer = meta_require_int(g, a + "block_count", 1, k_max_dim);
    // ggml asserts (aborts the process) on a graph over more layers than the file has tensors for.
    if (hp_.n_layer > gguf_get_n_tensors(g)) {
        throw std::runtime_error("GGUF " + a + "block_count=" + std::to_string(hp_.n_layer) + " but the file has only " +
                                 std::to_string(gguf_get_n_tensors(g)) + " tensors");
    }
    hp_.n_embd = meta_require_int(g, a + "embedding_length", 1, k_max_dim);
    // one width per layer where gemma4's differ; the dense families require it (load_dense_ffn)
    read_per_layer(g, a + "feed_forward_length", hp_.n_layer, hp_.n_ff, hp_.n_ff_layers);
    read_head_counts(g);
    hp_.n_ctx_train = meta_require_int(g, a + "context_length", 1, k_max_dim);
    hp_.head_dim_k = hp_.n_embd / hp_.n_head;
    meta_int(g, a + "attention.key_length", 1, k_max_dim, hp_.head_dim_k);
    hp_.head_dim_v = hp_.head_dim_k;
    meta_int(g, a + "attention.value_length", 1, k_max_dim, hp_.head_dim_v);
    if (hp_.head_dim_k <= 0) {
        throw std::runtime_error("GGUF head size " + a + "embedding_length / attention.head_count = " +
                                 std::to_string(hp_.n_embd) + " / " + std::to_string(hp_.n_head) +
                                 " is 0 (set attention.key_length)");
    }
    if (!meta_int(g, a + "vocab_size", 1, k_max_dim, hp_.n_vocab)) {
        if (!meta_array_n(g, "tokenizer.ggml.tokens", GGUF_TYPE_STRING, hp_.n_vocab)) {
            throw std::runtime_error("GGUF has neither " + a + "vocab_size nor tokenizer.ggml.tokens");
        }
        if (hp_.n_vocab < 1 || hp_.n_vocab > k_max_dim) {
            throw std::runtime_error("GGUF tokenizer.ggml.tokens has " + std::to_string(hp_.n_vocab) + " entries");
        }
    }
    read_rope(g);
    if (arch_->read_hparams) arch_->read_hparams(g, hp_);
    check_pooled_head_counts();
}

int64_t ModelHparams::n_swa_layers() const {
    int64_t n = 0;
    for (int64_t il = 0; il < n_layer; ++il) n += is_swa(il) && has_kv(il);
    return n;
}

int64_t ModelHparams::n_pooled_layers() const {
    int64_t n = 0;
    for (int64_t il = 0; il < n_layer; ++il) n += is_pooled(il);
    return n;
}

int64_t ModelHparams::n_recurrent_layers() const {
    int64_t n = 0;
    for (uint8_t f : recurrent_layers) n += f != 0;
    return n;
}

int64_t ModelHparams::kv_index(int64_t il) const {
    il = kv_source(il);
    int64_t i = 0;
    for (int64_t l = 0; l < il; ++l) i += is_swa(l) == is_swa(il) && is_recurrent(l) == is_recurrent(il) && has_kv(l);
    return i;
}


void Model::read_head_counts(gguf_context * g) {
    const std::string a = hp_.arch + ".", key = a + "attention.head_count";
    // one count per layer where laguna's differ
    if (!read_per_layer(g, key, hp_.n_layer, hp_.n_head, hp_.n_head_layers)) {
        throw std::runtime_error("GGUF is missing the required key " + key);
    }
    int64_t fewest = hp_.n_head;
    for (int64_t n : hp_.n_head_layers) fewest = std::min(fewest, n);
    hp_.n_head_kv = hp_.n_head;
    meta_int(g, a + "attention.head_count_kv", 1, fewest, hp_.n_head_kv);
    for (int64_t il = 0; il < hp_.n_layer; ++il) {
        if (hp_.n_head_of(il) % hp_.n_head_kv != 0) {
            throw std::runtime_error("GGUF " + key + "=" + std::to_string(hp_.n_head_of(il)) + " (layer " +
                                     std::to_string(il) + ") is not a multiple of head_count_kv=" +
                                     std::to_string(hp_.n_head_kv));
        }
    }
}

void Model::check_pooled_head_counts() const {
    // The scorers read one [n_head, head_dim] block of queries per pooled layer (StepQueries).
    int64_t first = -1;
    for (int64_t il = 0; il < hp_.n_layer; ++il) {
        if (!hp_.is_pooled(il)) continue;
        if (first < 0) first = il;
        if (hp_.n_head_of(il) != hp_.n_head_of(first)) {
            throw std::runtime_error("GGUF " + hp_.arch + ".attention.head_count differs between global layers " +
                                     std::to_string(first) + " and " + std::to_string(il) + ": unsupported");
        }
    }
}

void Model::read_rope(gguf_context * g) {
    const std::string a = hp_.arch + ".";
    hp_.rope_type = arch_->rope_type;
    hp_.n_rot = hp_.head_dim_k;
    meta_int(g, a + "rope.dimension_count", INT64_MIN, INT64_MAX, hp_.n_rot);
    if (hp_.n_rot <= 0 || hp_.n_rot % 2 != 0 || hp_.n_rot > hp_.head_dim_k) {
        throw std::runtime_error("GGUF " + a + "rope.dimension_count=" + std::to_string(hp_.n_rot) +
                                 " must be even and in [2, head size " + std::to_string(hp_.head_dim_k) + "]");
    }
    // Non-finite values are refused by meta_float; these are the ranges in which the graph stays finite.
    if (meta_float(g, a + "attention.layer_norm_rms_epsilon", hp_.rms_eps) && hp_.rms_eps < 0.0f) {
        throw std::runtime_error("GGUF " + a + "attention.layer_norm_rms_epsilon=" + std::to_string(hp_.rms_eps) +
                                 " must be finite and >= 0");
    }
    // Below 1 the RoPE frequencies grow with the dimension and overflow to inf (NaN logits), so no model
    // has such a base.
    if (meta_float(g, a + "rope.freq_base", hp_.rope_freq_base) && !(hp_.rope_freq_base >= 1.0f)) {
        throw std::runtime_error("GGUF " + a + "rope.freq_base=" + std::to_string(hp_.rope_freq_base) + " must be >= 1");
    }
    hp_.n_rot_swa = hp_.n_rot;
    meta_int(g, a + "rope.dimension_count_swa", INT64_MIN, INT64_MAX, hp_.n_rot_swa);
    if (hp_.n_rot_swa <= 0 || hp_.n_rot_swa % 2 != 0 || hp_.n_rot_swa > hp_.head_dim_k) {
        throw std::runtime_error("GGUF " + a + "rope.dimension_count_swa=" + std::to_string(hp_.n_rot_swa) +
                                 " must be even and in [2, head size " + std::to_string(hp_.head_dim_k) + "]");
    }
    std::string scaling = "none";
    meta_str(g, a + "rope.scaling.type", scaling);
    if (scaling != "none" && scaling != "linear" && scaling != "llama3" && scaling != "yarn") {
        throw std::runtime_error("unsupported rope scaling type '" + scaling + "' (supported: none, linear, llama3, yarn)");
    }
    float factor = 1.0f;
    if (meta_float(g, a + "rope.scaling.factor", factor) && !(factor > 0.0f)) {
        throw std::runtime_error("GGUF " + a + "rope.scaling.factor=" + std::to_string(factor) + " must be > 0");
    }
    if (scaling == "linear" || scaling == "yarn") hp_.rope_freq_scale = 1.0f / factor;
    float attn_factor = 1.0f;
    if (meta_float(g, a + "rope.scaling.attn_factor", attn_factor) && !(attn_factor > 0.0f)) {
        throw std::runtime_error("GGUF " + a + "rope.scaling.attn_factor=" + std::to_string(attn_factor) + " must be > 0");
    }
    hp_.n_ctx_orig_yarn = hp_.n_ctx_train;
    meta_int(g, a + "rope.scaling.original_context_length", 1, k_max_dim, hp_.n_ctx_orig_yarn);
    hp_.rope_attn_factor = attn_factor;
    if (scaling == "yarn") {
        // llama_context's YaRN magnitude: mscale(factor) = 1 + 0.1 ln(factor), divided by the same correction
        // ggml's rope applies itself when ext_factor != 0 (so it cancels for factor > 1).
        // Computed in libllama's order, from the scale as it keeps it, so the factor is the same float.
        hp_.rope_ext_factor = 1.0f;
        const float f = 1.0f / hp_.rope_freq_scale;
        float af = f <= 1.0f ? 1.0f : 0.1f * 1.0f * logf(f) + 1.0f;
        af *= 1.0f / (1.0f + 0.1f * logf(f));
        hp_.rope_attn_factor = af * attn_factor;
    }
}

void Model::load_tensors(gguf_context * gctx, ggml_context * meta, bool with_mtp) {
    GgufTensorSource src(meta);
    const auto & hp = hp_;
    // Resolve every tensor by name first (errors name what is missing), then copy data.
    ggml_tensor * m_tok = src.require("token_embd.weight", {hp.n_embd, hp.n_vocab});
    ggml_tensor * m_onorm = src.require("output_norm.weight", {hp.n_embd});
    ggml_tensor * m_out = src.optional("output.weight", {hp.n_embd, hp.n_vocab});
    ggml_tensor * m_freqs = hp.rope_freqs_per_layer ? nullptr : src.optional("rope_freqs.weight", {hp.n_rot / 2});
    ggml_tensor * m_ple_tok = nullptr, * m_ple_proj = nullptr, * m_ple_norm = nullptr;
    if (hp.n_embd_per_layer > 0) {
        const int64_t P = hp.n_embd_per_layer;
        m_ple_tok = src.require("per_layer_token_embd.weight", {P * hp.n_layer, hp.n_vocab});
        m_ple_proj = src.require("per_layer_model_proj.weight", {hp.n_embd, P * hp.n_layer});
        m_ple_norm = src.require("per_layer_proj_norm.weight", {P});
    }
    std::vector<LayerWeights> meta_layers(hp.n_layer);
    for (int il = 0; il < hp.n_layer; ++il) arch_->load_layer(meta_layers[il], src, hp, il);
    MtpWeights meta_mtp;   // the first nextn layer follows the trunk's
    if (with_mtp) arch_->mtp->load(meta_mtp, src, hp, (int) hp.n_layer);

    // Each device's weights context mirrors the meta tensors of the layers it holds. The inputs (token and per-layer
    // embeddings) go with layer 0, the output layer (final norm, logits, the MTP head) with slot n_layer; a
    // tensor used on several devices (tied output, RoPE factors) gets a copy on each, as llama.cpp does.
    const int64_t n_meta = gguf_get_n_tensors(gctx);
    for (ModelDevice & d : devices_) {
        ggml_init_params params = {ggml_tensor_overhead() * (size_t) (2 * n_meta + 1), nullptr, true};
        d.ctx_w = ggml_init(params);
    }
    struct Mirror { ggml_tensor * meta, * w; int device; bool copy; };   // copy: the file tensor is mirrored already
    std::vector<Mirror> pairs;
    auto mirror = [&](ggml_tensor * m, int dev) -> ggml_tensor * {
        if (!m) return nullptr;
        bool copy = false;
        for (auto & p : pairs) {
            if (p.meta == m && p.device == dev) return p.w;
            copy = copy || p.meta == m;
        }
        ggml_tensor * w = ggml_dup_tensor(devices_[(size_t) dev].ctx_w, m);
        ggml_set_name(w, ggml_get_name(m));
        pairs.push_back({m, w, dev, copy});
        return w;
    };
    const int d_in = device_of(0), d_out = device_of(hp.n_layer);
    tok_embd = mirror(m_tok, d_in);
    output_norm = mirror(m_onorm, d_out);
    output = mirror(m_out ? m_out : m_tok, d_out);
    for (int d = 0; d < n_devices(); ++d) {
        if (m_freqs) rope_freqs_.push_back(mirror(m_freqs, d));
    }
    per_layer_tok_embd = mirror(m_ple_tok, d_in);
    per_layer_model_proj = mirror(m_ple_proj, d_in);
    per_layer_proj_norm = mirror(m_ple_norm, d_in);
    layers.resize(hp.n_layer);
    for (int il = 0; il < hp.n_layer; ++il) {
        for (ggml_tensor * LayerWeights::* t : k_layer_tensors) layers[il].*t = mirror(meta_layers[il].*t, device_of(il));
    }
    for (ggml_tensor * LayerWeights::* t : k_layer_tensors) mtp.block.*t = mirror(meta_mtp.block.*t, d_out);
    for (ggml_tensor * MtpWeights::* t : {&MtpWeights::eh_proj, &MtpWeights::enorm, &MtpWeights::hnorm,
                                          &MtpWeights::embed_tokens, &MtpWeights::head_norm, &MtpWeights::head}) {
        mtp.*t = mirror(meta_mtp.*t, d_out);
    }
    for (ModelDevice & d : devices_) {
        if (!ggml_get_first_tensor(d.ctx_w)) continue;   // a device the split left without a layer
        d.buf_w = ggml_backend_alloc_ctx_tensors(d.ctx_w, d.backend);
        if (!d.buf_w) throw std::runtime_error("could not allocate the weights on " + std::string(ggml_backend_name(d.backend)));
        ggml_backend_buffer_set_usage(d.buf_w, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    }

    std::FILE * f = std::fopen(path_.c_str(), "rb");
    if (!f) throw std::runtime_error("cannot open model file '" + path_ + "'");
    std::unique_ptr<std::FILE, decltype(&std::fclose)> fguard(f, std::fclose);
    std::fseek(f, 0, SEEK_END);
    const int64_t file_size = ftello(f);
    const int64_t data_off = (int64_t) gguf_get_data_offset(gctx);
    std::vector<uint8_t> staging;
    uint64_t h = 0xcbf29ce484222325ULL;   // over each file tensor once, whatever the split
    for (auto & [m, w, dev, copy] : pairs) {
        const int64_t id = gguf_find_tensor(gctx, ggml_get_name(m));
        const int64_t off = data_off + (int64_t) gguf_get_tensor_offset(gctx, id);
        const size_t n = ggml_nbytes(m);
        if (off + (int64_t) n > file_size) {
            throw std::runtime_error("'" + path_ + "' is truncated: tensor " + ggml_get_name(m) + " needs bytes up to " +
                                     std::to_string(off + n) + " but the file has " + std::to_string(file_size));
        }
        staging.resize(n);
        if (fseeko(f, off, SEEK_SET) != 0 || std::fread(staging.data(), 1, n, f) != n) {
            throw std::runtime_error("read error in '" + path_ + "' at tensor " + ggml_get_name(m));
        }
        if (!copy) h = hash_bytes(h, staging.data(), n);
        ggml_backend_tensor_set(w, staging.data(), 0, n);
    }
    check_rpc_connections();   // the weights reached every device
    weights_hash_ = h;
}

void Model::check_rpc_connections() const {
    for (const ModelDevice & d : devices_) check_rpc_connection(d.backend);
}

int64_t Model::device_weight_bytes(int d) const {
    const ggml_backend_buffer_t b = devices_[(size_t) d].buf_w;
    return b ? (int64_t) ggml_backend_buffer_get_size(b) : 0;
}

void Model::device_memory(int d, size_t & free, size_t & total) const {
    free = total = 0;
    ggml_backend_t b = device_backend(d);
    ggml_backend_dev_memory(ggml_backend_get_device(b), &free, &total);
    check_rpc_connection(b);
}

int64_t Model::weight_bytes() const {
    int64_t n = 0;
    for (int d = 0; d < n_devices(); ++d) n += device_weight_bytes(d);
    return n;
}

std::string Model::fingerprint() const {
    std::ostringstream s;
    s << hp_.arch << ":L" << hp_.n_layer << ":E" << hp_.n_embd << ":H" << hp_.n_head << "/" << hp_.n_head_kv
      << ":D" << hp_.head_dim_k << "/" << hp_.head_dim_v << ":F" << hp_.n_ff << ":V" << hp_.n_vocab
      << (has_mtp() ? ":MTP" : "") << ":W" << std::hex << weights_hash_;
    return s.str();
}

}  // namespace kvf
