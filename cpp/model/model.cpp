#include "model/model.h"

#include "model/backends.h"
#include "gguf.h"

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

// Integer metadata may be stored as any integer type; llama.cpp accepts all of them, so do we.
bool get_int(gguf_context * g, const std::string & key, int64_t & out) {
    const int64_t id = gguf_find_key(g, key.c_str());
    if (id < 0) return false;
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_UINT8:  out = gguf_get_val_u8(g, id);  return true;
        case GGUF_TYPE_INT8:   out = gguf_get_val_i8(g, id);  return true;
        case GGUF_TYPE_UINT16: out = gguf_get_val_u16(g, id); return true;
        case GGUF_TYPE_INT16:  out = gguf_get_val_i16(g, id); return true;
        case GGUF_TYPE_UINT32: out = gguf_get_val_u32(g, id); return true;
        case GGUF_TYPE_INT32:  out = gguf_get_val_i32(g, id); return true;
        case GGUF_TYPE_UINT64: out = (int64_t) gguf_get_val_u64(g, id); return true;
        case GGUF_TYPE_INT64:  out = gguf_get_val_i64(g, id); return true;
        case GGUF_TYPE_ARRAY:  // per-layer arrays (e.g. head_count_kv): take the first, all must agree
            if (gguf_get_arr_type(g, id) == GGUF_TYPE_INT32 || gguf_get_arr_type(g, id) == GGUF_TYPE_UINT32) {
                const auto * v = (const int32_t *) gguf_get_arr_data(g, id);
                const size_t n = gguf_get_arr_n(g, id);
                for (size_t i = 1; i < n; ++i) {
                    if (v[i] != v[0]) throw std::runtime_error("GGUF key " + key + " varies per layer: unsupported");
                }
                if (n > 0) { out = v[0]; return true; }
            }
            break;
        default: break;
    }
    throw std::runtime_error("GGUF key " + key + " is not an integer");
}

bool get_float(gguf_context * g, const std::string & key, float & out) {
    const int64_t id = gguf_find_key(g, key.c_str());
    if (id < 0) return false;
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_FLOAT32: out = gguf_get_val_f32(g, id); return true;
        case GGUF_TYPE_FLOAT64: out = (float) gguf_get_val_f64(g, id); return true;
        default: throw std::runtime_error("GGUF key " + key + " is not a float");
    }
}

int64_t require_int(gguf_context * g, const std::string & key) {
    int64_t v = 0;
    if (!get_int(g, key, v)) throw std::runtime_error("GGUF is missing the required key " + key);
    return v;
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
private:
    ggml_context * meta_;
};

ggml_backend_t pick_backend(const std::string & want) {
    if (want == "cpu") return nullptr;
    if (want != "auto" && want != "cuda") {
        throw std::invalid_argument("unknown backend '" + want + "' (expected auto, cpu or cuda)");
    }
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU);
    if (!dev) {
        if (want == "cuda") throw std::runtime_error("backend 'cuda' requested, but no GPU backend is available "
                                                     "(build with KVFLASH_CUDA=ON on a machine with a GPU)");
        return nullptr;
    }
    ggml_backend_t b = ggml_backend_dev_init(dev, nullptr);
    if (!b) throw std::runtime_error(std::string("could not initialise GPU backend ") + ggml_backend_dev_name(dev));
    return b;
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
    std::FILE * f = std::fopen(path.c_str(), "rb");
    if (!f) throw std::runtime_error("cannot open model file '" + path + "'");
    std::fclose(f);

    ggml_context * meta = nullptr;
    gguf_init_params gp = {/*no_alloc =*/ true, /*ctx =*/ &meta};
    gguf_context * gctx = gguf_init_from_file(path.c_str(), gp);
    if (!gctx) throw std::runtime_error("'" + path + "' is not a valid GGUF file (bad magic, or truncated metadata)");
    std::unique_ptr<gguf_context, decltype(&gguf_free)> gguard(gctx, gguf_free);
    std::unique_ptr<ggml_context, decltype(&ggml_free)> mguard(meta, ggml_free);

    read_hparams(gctx);

    cpu_backend_ = cpu_backend_init();
    set_n_threads(opts.n_threads);
    backend_ = pick_backend(opts.backend);
    if (!backend_) backend_ = cpu_backend_;

    try {
        load_tensors(gctx, meta);
    } catch (...) {
        if (buf_w_) ggml_backend_buffer_free(buf_w_);
        if (ctx_w_) ggml_free(ctx_w_);
        if (backend_ != cpu_backend_) ggml_backend_free(backend_);
        ggml_backend_free(cpu_backend_);
        throw;
    }
}

Model::~Model() {
    if (buf_w_) ggml_backend_buffer_free(buf_w_);
    if (ctx_w_) ggml_free(ctx_w_);
    if (backend_ && backend_ != cpu_backend_) ggml_backend_free(backend_);
    if (cpu_backend_) ggml_backend_free(cpu_backend_);
}

void Model::set_n_threads(int n) {
    n_threads_ = n > 0 ? n : std::max(1u, std::thread::hardware_concurrency());
    set_backend_threads(cpu_backend_, n_threads_);
}

void Model::read_hparams(gguf_context * g) {
    const int64_t arch_id = gguf_find_key(g, "general.architecture");
    if (arch_id < 0) throw std::runtime_error("GGUF has no general.architecture key");
    hp_.arch = gguf_get_val_str(g, arch_id);
    arch_ = find_arch(hp_.arch);
    if (!arch_) {
        throw std::runtime_error("unsupported architecture '" + hp_.arch + "' (supported: " + supported_archs() + ")");
    }
    const int64_t name_id = gguf_find_key(g, "general.name");
    if (name_id >= 0) hp_.name = gguf_get_val_str(g, name_id);

    const std::string a = hp_.arch + ".";
    hp_.n_layer     = require_int(g, a + "block_count");
    hp_.n_embd      = require_int(g, a + "embedding_length");
    hp_.n_ff        = require_int(g, a + "feed_forward_length");
    hp_.n_head      = require_int(g, a + "attention.head_count");
    hp_.n_head_kv   = hp_.n_head;
    get_int(g, a + "attention.head_count_kv", hp_.n_head_kv);
    hp_.n_ctx_train = require_int(g, a + "context_length");
    hp_.head_dim_k  = hp_.n_embd / hp_.n_head;
    get_int(g, a + "attention.key_length", hp_.head_dim_k);
    hp_.head_dim_v  = hp_.head_dim_k;
    get_int(g, a + "attention.value_length", hp_.head_dim_v);
    hp_.n_rot       = hp_.head_dim_k;
    get_int(g, a + "rope.dimension_count", hp_.n_rot);
    get_float(g, a + "attention.layer_norm_rms_epsilon", hp_.rms_eps);
    get_float(g, a + "rope.freq_base", hp_.rope_freq_base);
    hp_.rope_type = arch_->rope_type;

    const int64_t st = gguf_find_key(g, (a + "rope.scaling.type").c_str());
    const std::string scaling = st >= 0 ? gguf_get_val_str(g, st) : "none";
    float factor = 0.0f;
    get_float(g, a + "rope.scaling.factor", factor);
    if (scaling == "linear" && factor > 0.0f) {
        hp_.rope_freq_scale = 1.0f / factor;
    } else if (scaling != "none" && scaling != "linear" && !(scaling == "llama3")) {
        throw std::runtime_error("unsupported rope scaling type '" + scaling + "' (supported: none, linear, llama3)");
    }

    if (!get_int(g, a + "vocab_size", hp_.n_vocab)) {
        const int64_t tok = gguf_find_key(g, "tokenizer.ggml.tokens");
        if (tok < 0) throw std::runtime_error("GGUF has neither " + a + "vocab_size nor tokenizer.ggml.tokens");
        hp_.n_vocab = (int64_t) gguf_get_arr_n(g, tok);
    }
    if (hp_.n_layer <= 0 || hp_.n_embd <= 0 || hp_.n_head <= 0 || hp_.n_head_kv <= 0 || hp_.n_head % hp_.n_head_kv != 0) {
        throw std::runtime_error("GGUF hyperparameters are inconsistent (n_layer, n_embd, n_head, n_head_kv)");
    }
    // ggml asserts (aborts the process) on what follows, so a bad file must be refused here.
    if (hp_.n_layer > gguf_get_n_tensors(g)) {
        throw std::runtime_error("GGUF " + a + "block_count=" + std::to_string(hp_.n_layer) + " but the file has only " +
                                 std::to_string(gguf_get_n_tensors(g)) + " tensors");
    }
    if (hp_.head_dim_k <= 0 || hp_.head_dim_v <= 0) {
        throw std::runtime_error("GGUF head sizes must be positive (key_length=" + std::to_string(hp_.head_dim_k) +
                                 ", value_length=" + std::to_string(hp_.head_dim_v) + ")");
    }
    if (hp_.n_rot <= 0 || hp_.n_rot % 2 != 0 || hp_.n_rot > hp_.head_dim_k) {
        throw std::runtime_error("GGUF " + a + "rope.dimension_count=" + std::to_string(hp_.n_rot) +
                                 " must be even and in [2, head size " + std::to_string(hp_.head_dim_k) + "]");
    }
    if (!(hp_.rms_eps >= 0.0f) || !std::isfinite(hp_.rms_eps)) {
        throw std::runtime_error("GGUF " + a + "attention.layer_norm_rms_epsilon=" + std::to_string(hp_.rms_eps) +
                                 " must be finite and >= 0");
    }
}

void Model::load_tensors(gguf_context * gctx, ggml_context * meta) {
    GgufTensorSource src(meta);
    const auto & hp = hp_;
    // Resolve every tensor by name first (errors name what is missing), then copy data.
    ggml_tensor * m_tok = src.require("token_embd.weight", {hp.n_embd, hp.n_vocab});
    ggml_tensor * m_onorm = src.require("output_norm.weight", {hp.n_embd});
    ggml_tensor * m_out = src.optional("output.weight", {hp.n_embd, hp.n_vocab});
    ggml_tensor * m_freqs = src.optional("rope_freqs.weight", {hp.n_rot / 2});
    std::vector<LayerWeights> meta_layers(hp.n_layer);
    for (int il = 0; il < hp.n_layer; ++il) arch_->load_layer(meta_layers[il], src, hp, il);

    // The weights context mirrors the used meta tensors one to one.
    const int64_t n_meta = gguf_get_n_tensors(gctx);
    ggml_init_params params = {ggml_tensor_overhead() * (size_t) (n_meta + 1), nullptr, true};
    ctx_w_ = ggml_init(params);
    std::vector<std::pair<ggml_tensor *, ggml_tensor *>> pairs;   // (meta, weight)
    auto mirror = [&](ggml_tensor * m) -> ggml_tensor * {
        if (!m) return nullptr;
        for (auto & p : pairs) if (p.first == m) return p.second;
        ggml_tensor * w = ggml_dup_tensor(ctx_w_, m);
        ggml_set_name(w, ggml_get_name(m));
        pairs.emplace_back(m, w);
        return w;
    };
    tok_embd = mirror(m_tok);
    output_norm = mirror(m_onorm);
    output = m_out ? mirror(m_out) : tok_embd;
    rope_freqs = mirror(m_freqs);
    layers.resize(hp.n_layer);
    for (int il = 0; il < hp.n_layer; ++il) {
        const LayerWeights & m = meta_layers[il];
        LayerWeights & w = layers[il];
        w = {mirror(m.attn_norm), mirror(m.wq), mirror(m.wk), mirror(m.wv), mirror(m.wo),
             mirror(m.bq), mirror(m.bk), mirror(m.bv), mirror(m.q_norm), mirror(m.k_norm),
             mirror(m.ffn_norm), mirror(m.ffn_gate), mirror(m.ffn_up), mirror(m.ffn_down)};
    }
    buf_w_ = ggml_backend_alloc_ctx_tensors(ctx_w_, backend_);
    if (!buf_w_) throw std::runtime_error("could not allocate the weights on " + std::string(ggml_backend_name(backend_)));
    ggml_backend_buffer_set_usage(buf_w_, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);

    std::FILE * f = std::fopen(path_.c_str(), "rb");
    if (!f) throw std::runtime_error("cannot open model file '" + path_ + "'");
    std::unique_ptr<std::FILE, decltype(&std::fclose)> fguard(f, std::fclose);
    std::fseek(f, 0, SEEK_END);
    const int64_t file_size = ftello(f);
    const int64_t data_off = (int64_t) gguf_get_data_offset(gctx);
    std::vector<uint8_t> staging;
    uint64_t h = 0xcbf29ce484222325ULL;
    for (auto & [m, w] : pairs) {
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
        h = hash_bytes(h, staging.data(), n);
        ggml_backend_tensor_set(w, staging.data(), 0, n);
    }
    weights_hash_ = h;
}

int64_t Model::weight_bytes() const { return buf_w_ ? (int64_t) ggml_backend_buffer_get_size(buf_w_) : 0; }

std::string Model::fingerprint() const {
    std::ostringstream s;
    s << hp_.arch << ":L" << hp_.n_layer << ":E" << hp_.n_embd << ":H" << hp_.n_head << "/" << hp_.n_head_kv
      << ":D" << hp_.head_dim_k << "/" << hp_.head_dim_v << ":F" << hp_.n_ff << ":V" << hp_.n_vocab << ":W" << std::hex
      << weights_hash_;
    return s.str();
}

}  // namespace kvf
