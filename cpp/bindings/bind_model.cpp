#include "bindings/bindings.h"

#include "model/backends.h"
#include "model/gguf_meta.h"
#include "model/quant_matmul.h"
#include "model/model.h"
#include "model/rpc.h"
#include "model/vocab.h"
#include "reference/llama_reference.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <map>
#include <mutex>
#include <optional>

namespace kvf::bind {

namespace {
// A libllama context is not safe for two threads, and decode runs without the GIL: every LlamaReference
// call holds this (one for all of them: the reference is for tests, never on a hot path).
std::mutex g_reference_mutex;

template <typename Fn> auto reference_call(Fn && fn) {
    return without_gil([&] {
        const std::lock_guard<std::mutex> held(g_reference_mutex);
        return fn();
    });
}

py::array_t<float> logits_array(std::vector<float> && v, int64_t n_rows, int64_t n_vocab, bool all) {
    auto * heap = new std::vector<float>(std::move(v));
    py::capsule owner(heap, [](void * p) { delete static_cast<std::vector<float> *>(p); });
    if (all) return py::array_t<float>({(py::ssize_t) n_rows, (py::ssize_t) n_vocab}, heap->data(), owner);
    return py::array_t<float>({(py::ssize_t) n_vocab}, heap->data(), owner);
}

void bind_vocab(py::module_ & m) {
    py::class_<Vocab>(m, "Vocab")
        .def(py::init<const std::string &>(), py::arg("path"))
        .def("tokenize", &Vocab::tokenize, py::arg("text"), py::kw_only(), py::arg("add_special") = true,
             py::arg("parse_special") = false)
        .def("tokenize_with_text_spans", [](const Vocab & v, const std::string & text,
                                            const std::vector<std::pair<int64_t, int64_t>> & text_spans, bool add_special) {
                 int64_t kept = 0;
                 std::vector<int32_t> tokens = v.tokenize_with_text_spans(text, text_spans, add_special, &kept);
                 return py::make_tuple(tokens, kept);
             }, py::arg("text"), py::arg("text_spans"), py::kw_only(), py::arg("add_special") = false,
             "(tokens of text parsing control tokens outside text_spans (sorted [lo, hi) byte ranges) only, how many "
             "control-token texts inside them stayed text)")
        .def("find_control_text", &Vocab::find_control_text, py::arg("text"),
             "(byte offset, token id) of the first control or unknown token's text in text, or (-1, -1)")
        .def("detokenize", &Vocab::detokenize, py::arg("tokens"), py::kw_only(), py::arg("remove_special") = false,
             py::arg("unparse_special") = false)
        .def("token_to_piece", [](const Vocab & v, int32_t t, bool special) { return py::bytes(v.token_to_piece(t, special)); },
             py::arg("token"), py::kw_only(), py::arg("special") = false)
        .def("pieces", [](const Vocab & v, const std::vector<int32_t> & tokens, bool special) {
                 std::vector<int64_t> offsets;
                 std::string text = v.pieces(tokens, special, offsets);
                 py::array_t<int64_t> off((py::ssize_t) offsets.size());
                 std::copy(offsets.begin(), offsets.end(), off.mutable_data());
                 return py::make_tuple(py::bytes(text), off);
             }, py::arg("tokens"), py::kw_only(), py::arg("special") = true,
             "(bytes of the pieces laid end to end, int64 [n + 1] byte offset where each starts, then the total)")
        .def_property_readonly("n_vocab", &Vocab::n_vocab)
        .def_property_readonly("bos", &Vocab::bos)
        .def_property_readonly("eos", &Vocab::eos)
        .def_property_readonly("eot", &Vocab::eot)
        .def_property_readonly("add_bos", &Vocab::add_bos)
        .def("is_eog", &Vocab::is_eog, py::arg("token"))
        .def_property_readonly("chat_template", &Vocab::chat_template)
        .def("meta", &Vocab::meta, py::arg("key"));
    m.def("builtin_chat_template", &builtin_chat_template, py::arg("name"), py::arg("messages"),
          py::arg("add_generation_prompt") = true,
          "libllama's formatting of one of its built-in chat templates, by name, for (role, content) messages");
}

// libllama as the test reference (kvflash_ggml._core.testing).
void bind_reference(py::module_ & testing) {
    py::class_<LlamaReference>(testing, "LlamaReference")
        .def(py::init<const std::string &, int, int, bool, int, bool, bool>(), py::arg("path"), py::kw_only(),
             py::arg("n_ctx"), py::arg("n_threads") = 2, py::arg("flash_attn") = false, py::arg("n_gpu_layers") = 0,
             py::arg("repack") = true, py::arg("mtp") = false,
             "mtp: also libllama's multi-token-prediction context, fed every decoded batch (mtp_draft)")
        .def("decode", [](LlamaReference & r, const std::vector<int32_t> & tokens, bool all) {
                 std::vector<float> out = reference_call([&] { return r.decode(tokens, all); });
                 return logits_array(std::move(out), (int64_t) tokens.size(), r.n_vocab(), all);
             }, py::arg("tokens"), py::kw_only(), py::arg("all_logits") = false)
        .def("clear", [](LlamaReference & r) { reference_call([&] { r.clear(); }); })
        .def("remove", [](LlamaReference & r, int64_t p0, int64_t p1) { reference_call([&] { r.remove(p0, p1); }); },
             py::arg("p0"), py::arg("p1"))
        .def("mtp_draft", [](LlamaReference & r, const std::vector<int32_t> & tokens) {
                 std::vector<float> out = reference_call([&] { return r.mtp_draft(tokens); });
                 return logits_array(std::move(out), (int64_t) tokens.size(), r.n_vocab(), true);
             }, py::arg("tokens"),
             "the MTP context's logits [len(tokens), n_vocab] of a draft chain: tokens[0] at n_past (with the trunk's "
             "last h_nextn), tokens[i] at n_past + i (with the MTP's own output of step i - 1)")
        .def_property_readonly("n_past", [](const LlamaReference & r) { return reference_call([&] { return r.n_past(); }); });
}

// A per-layer figure of every layer, as a list.
std::vector<int64_t> per_layer(const ModelHparams & hp, int64_t (ModelHparams::*of)(int64_t) const) {
    std::vector<int64_t> v;
    for (int64_t il = 0; il < hp.n_layer; ++il) v.push_back((hp.*of)(il));
    return v;
}

}  // namespace

py::array_t<float> make_logits(std::vector<float> && v, int64_t n_rows, int64_t n_vocab, bool all) {
    return logits_array(std::move(v), n_rows, n_vocab, all);
}

namespace {

void bind_hparams(py::module_ & m) {
    py::class_<ModelHparams>(m, "ModelHparams")
        .def_readonly("arch", &ModelHparams::arch)
        .def_readonly("name", &ModelHparams::name)
        .def_readonly("n_vocab", &ModelHparams::n_vocab)
        .def_readonly("n_embd", &ModelHparams::n_embd)
        .def_readonly("n_layer", &ModelHparams::n_layer)
        .def_readonly("n_head", &ModelHparams::n_head)
        .def_readonly("n_head_kv", &ModelHparams::n_head_kv)
        .def_property_readonly("n_head_layers", [](const ModelHparams & hp) { return per_layer(hp, &ModelHparams::n_head_of); })
        .def_readonly("head_dim_k", &ModelHparams::head_dim_k)
        .def_readonly("head_dim_v", &ModelHparams::head_dim_v)
        .def_readonly("head_dim_k_swa", &ModelHparams::head_dim_k_swa)
        .def_readonly("head_dim_v_swa", &ModelHparams::head_dim_v_swa)
        .def_readonly("n_layer_kv", &ModelHparams::n_layer_kv)
        .def_readonly("n_embd_per_layer", &ModelHparams::n_embd_per_layer)
        .def_property_readonly("n_ff_layers", [](const ModelHparams & hp) { return per_layer(hp, &ModelHparams::n_ff_of); })
        .def_readonly("logit_softcap", &ModelHparams::logit_softcap)
        .def_readonly("n_ff", &ModelHparams::n_ff)
        .def_readonly("n_ctx_train", &ModelHparams::n_ctx_train)
        .def_readonly("rope_freq_base", &ModelHparams::rope_freq_base)
        .def_readonly("n_swa", &ModelHparams::n_swa)
        .def_readonly("swa_layers", &ModelHparams::swa_layers)
        .def_readonly("recurrent_layers", &ModelHparams::recurrent_layers)
        .def_readonly("ssm_d_conv", &ModelHparams::ssm_d_conv)
        .def_readonly("ssm_d_inner", &ModelHparams::ssm_d_inner)
        .def_readonly("ssm_d_state", &ModelHparams::ssm_d_state)
        .def_readonly("ssm_dt_rank", &ModelHparams::ssm_dt_rank)
        .def_readonly("ssm_n_group", &ModelHparams::ssm_n_group)
        .def_readonly("n_expert", &ModelHparams::n_expert)
        .def_readonly("n_expert_used", &ModelHparams::n_expert_used)
        .def_readonly("n_ff_exp", &ModelHparams::n_ff_exp)
        .def_readonly("n_ff_shexp", &ModelHparams::n_ff_shexp)
        .def_property_readonly("n_pooled_layers", &ModelHparams::n_pooled_layers)
        .def_readonly("n_layer_nextn", &ModelHparams::n_layer_nextn,
                      "multi-token-prediction (nextn) layers in the file, after the trunk's n_layer");

}

void bind_model_class(py::module_ & m) {
    py::class_<Model, std::shared_ptr<Model>>(m, "Model")
        .def(py::init([](const std::string & path, const std::string & backend, int n_threads, bool mtp,
                         const std::vector<std::string> & rpc, const std::vector<std::string> & devices,
                         const std::vector<double> & tensor_split) {
                 py::gil_scoped_release nogil;
                 ModelOptions o;
                 o.backend = backend;
                 o.n_threads = n_threads;
                 o.mtp = mtp;
                 o.rpc = rpc;
                 o.devices = devices;
                 o.tensor_split = tensor_split;
                 return std::make_shared<Model>(path, o);
             }),
             py::arg("path"), py::kw_only(), py::arg("backend") = "auto", py::arg("n_threads") = 0, py::arg("mtp") = false,
             py::arg("rpc") = std::vector<std::string>{}, py::arg("devices") = std::vector<std::string>{},
             py::arg("tensor_split") = std::vector<double>{},
             "mtp: also load the first multi-token-prediction (nextn) layer, the head Session(mtp=True) drafts with "
             "(ValueError for a file or family without one). The layers are split across devices as llama.cpp splits "
             "them: rpc: ['host:port', ...] of ggml-rpc-servers (the first device of each), then this host's GPU "
             "(backend 'auto' if there is one, 'cuda' required; 'rpc': the servers alone); or devices: the list in "
             "layer order ('cpu', 'cudaN', 'rpc:HOST:PORT'). tensor_split: each device's share of the layers "
             "(default: by free memory). Each endpoint is checked first: ValueError for a bad spelling, "
             "ConnectionError when it does not answer within 5 s; a connection lost later (see set_rpc_timeout) is a "
             "ConnectionError where a result is read")
        .def_property_readonly("has_mtp", &Model::has_mtp, "the multi-token-prediction head is loaded")
        .def_property_readonly("hparams", &Model::hparams)
        .def_property_readonly("path", &Model::path)
        .def_property_readonly("on_gpu", &Model::on_gpu, "weights on a device other than the local CPU (GPU or RPC)")
        .def_property_readonly("on_rpc", &Model::on_rpc, "weights and pool on an RPC device")
        .def_property_readonly("backend_name", [](const Model & mo) { return std::string(ggml_backend_name(mo.backend())); })
        .def_property("n_threads", &Model::n_threads,
                      py::cpp_function(&Model::set_n_threads, py::call_guard<py::gil_scoped_release>()))
        .def_property_readonly("weight_bytes", &Model::weight_bytes)
        .def_property_readonly("devices", [](const Model & mo) {
                 py::list out;
                 const int64_t n_layer = mo.hparams().n_layer;
                 for (int d = 0; d < mo.n_devices(); ++d) {
                     py::list held;
                     for (int64_t il = 0; il <= n_layer; ++il) if (mo.device_of(il) == d) held.append(il);
                     py::dict e;
                     e["name"] = std::string(ggml_backend_name(mo.device_backend(d)));
                     e["layers"] = held;
                     e["weight_bytes"] = mo.device_weight_bytes(d);
                     out.append(e);
                 }
                 return out;
             }, "the split: per device (in layer order) its name, the layers it holds (n_layer: the output layer) and "
                "its weight bytes")
        .def("device_memory", [](const Model & mo) {
                 struct Reading { std::string name, kind; size_t free = 0, total = 0; int64_t weights = 0; };
                 std::vector<Reading> readings;
                 {
                     py::gil_scoped_release nogil;   // an RPC device asks its server over the network
                     for (int d = 0; d < mo.n_devices(); ++d) {
                         Reading r;
                         r.name = ggml_backend_name(mo.device_backend(d));
                         r.kind = mo.device_is_cpu(d) ? "cpu" : mo.device_is_rpc(d) ? "rpc" : "gpu";
                         mo.device_memory(d, r.free, r.total);
                         r.weights = mo.device_weight_bytes(d);
                         readings.push_back(std::move(r));
                     }
                 }
                 py::list out;
                 for (const Reading & r : readings) {
                     py::dict e;
                     e["name"] = r.name;
                     e["kind"] = r.kind;
                     e["memory_free"] = r.free;
                     e["memory_total"] = r.total;
                     e["weight_bytes"] = r.weights;
                     out.append(e);
                 }
                 return out;
             }, "per device of the split (in layer order): {name, kind ('cpu': this host's CPU, 'gpu', 'rpc'), "
                "memory_free, memory_total (ggml_backend_dev_memory now: for an RPC device its server's figures), "
                "weight_bytes (this model's weights there)}; ConnectionError for an RPC device whose connection was "
                "lost")
        .def_property_readonly("fingerprint", &Model::fingerprint);
}

// The module's functions: architectures, devices, GGUF headers, RPC endpoints.
void bind_module_functions(py::module_ & m) {
    m.def("supported_archs", &supported_archs);
    m.def("gpu_devices", [] {
        // What backend="auto" can pick: every GPU device ggml was built with, with its memory now.
        py::list out;
        for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
            ggml_backend_dev_t dev = ggml_backend_dev_get(i);
            if (ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_GPU) continue;
            size_t free = 0, total = 0;
            ggml_backend_dev_memory(dev, &free, &total);
            py::dict d;
            d["name"] = ggml_backend_dev_name(dev);
            d["description"] = ggml_backend_dev_description(dev);
            d["memory_free"] = free;
            d["memory_total"] = total;
            out.append(d);
        }
        return out;
    }, "GPU devices of the compiled-in ggml backends: [{name, description, memory_free, memory_total}]");
    m.def("gguf_header", [](const std::string & path) {
        // What the CLI's flags need before weights or vocabulary load (--n-ctx 0, -ngl N): the same checked reads
        // as a Model's, without libllama's vocabulary (2.6 s for Gemma 3's 262K tokens).
        const std::unique_ptr<GgufFile> f = open_gguf(path, false);
        std::string arch;
        if (!meta_str(f->gguf, "general.architecture", arch)) throw std::runtime_error("GGUF has no general.architecture key");
        py::dict out;
        out["architecture"] = arch;
        out["context_length"] = meta_require_int(f->gguf, arch + ".context_length", 1, INT32_MAX);
        out["block_count"] = meta_require_int(f->gguf, arch + ".block_count", 1, INT32_MAX);
        return out;
    }, py::arg("path"), "{architecture, context_length, block_count} from a GGUF's metadata (RuntimeError naming "
       "the reason for a file that is not a valid GGUF or lacks them)");
    m.def("device_bytes_taken", [] {
        py::dict out;
        for (const kvf::DeviceTaken & d : kvf::device_bytes_taken()) out[py::str(d.name)] = d.bytes;
        return out;
    }, "The driver's view, per GPU a Model of this process opened: {name: bytes used now above what was used when "
       "it was first opened (its CUDA context made, no weight yet)}: everything the process holds there, ggml's "
       "CUDA pool and cuBLAS workspace included, every Model of the process together. The whole device's view: "
       "another process on the same GPU moves it. Empty without a GPU.");
    // RPC endpoints: checked before ggml-rpc sees them (it aborts the process on a failed connect); RpcLost,
    // a connection lost later, is one of them.
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const RpcUnreachable & e) {
            PyErr_SetString(PyExc_ConnectionError, e.what());
        }
    });
    m.def("rpc_available", &rpc_available, "ggml's RPC backend is in this build (KVFLASH_RPC=ON)");
    m.def("parse_rpc_endpoint", [](const std::string & e) {
        const RpcEndpoint ep = parse_rpc_endpoint(e);
        return py::make_tuple(ep.host, ep.port);
    }, py::arg("endpoint"), "'host:port' -> (host, port); ValueError for anything else");
    m.def("check_rpc_endpoint", [](const std::string & e, double timeout_s) {
        const RpcEndpoint ep = parse_rpc_endpoint(e);
        py::gil_scoped_release nogil;
        check_rpc_endpoint(ep, timeout_s);
    }, py::arg("endpoint"), py::arg("timeout_s") = 5.0,
       "connect and run ggml-rpc's handshake; ConnectionError naming the endpoint if it does not answer in time");
    m.def("set_rpc_timeout", &set_rpc_timeout, py::arg("seconds"),
          "send/receive timeout of RPC connections made from now on (process-wide; 0: none; default 120 s): a "
          "server that makes no progress for that long counts as lost (ConnectionError)");
    m.def("rpc_timeout", &rpc_timeout, "the timeout set_rpc_timeout sets, in seconds (0: none)");
}

}  // namespace

void register_model(py::module_ & m, py::module_ & testing) {
    bind_hparams(m);
    bind_model_class(m);
    bind_module_functions(m);
    bind_vocab(m);
    bind_reference(testing);
    testing.def("quant_mul_mat", [](std::optional<bool> enabled) {
            if (enabled) set_quant_mul_mat_mode(*enabled ? -1 : 0);
            return without_gil([] {
                return std::map<std::string, bool>{{"q4_1", quant_mul_mat_usable(GGML_TYPE_Q4_1)},
                                                   {"q8_0", quant_mul_mat_usable(GGML_TYPE_Q8_0)}};
            });
        }, py::arg("enabled") = py::none(),
        "per weight type, whether graphs built from now on run it times several tokens through our kernels (ggml's "
        "sums, several tokens per pass: model/quant_matmul.h); enabled=False: ggml_mul_mat everywhere, True: back "
        "to automatic (where the check against ggml passed)");
}

}  // namespace kvf::bind
