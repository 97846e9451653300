#include "bindings/bindings.h"

#include "runtime/batch_decoder.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <optional>

namespace kvf::bind {

#define KEEP_QUERIES_DOC \
    "keep_queries: one bool per session (None: all): which sessions that score chunks keep this step's queries " \
    "(the others' queries() and chunk_scores() refuse until their next step)"

py::array_t<float> make_logits(std::vector<float> && v, int64_t n_rows, int64_t n_vocab, bool all);

void register_batch(py::module_ & m) {
    py::class_<PoolArena, std::shared_ptr<PoolArena>>(m, "PoolArena",
                             "The pools of several sessions of one Model in one allocation, one lane each "
                             "(kv/pool_arena.h): a BatchDecoder step then writes and attends all of them at once. "
                             "Pass it to Session(model, config, arena=...); the first session fixes the pool layout.")
        .def(py::init<int64_t>(), py::arg("lanes"))
        .def_property_readonly("lanes", &PoolArena::n_lanes)
        .def_property_readonly("lanes_free", &PoolArena::lanes_free, "lanes no session holds")
        .def_property_readonly("device_bytes", &PoolArena::device_bytes, "bytes of every lane (0 until a session joins)");
    py::class_<BatchDecoder>(m, "BatchDecoder",
                             "One decode step of several sessions of one Model as one graph: the weights are read once "
                             "for all of them, attention runs per session over its own pool (runtime/batch_decoder.h).")
        .def(py::init<std::shared_ptr<Model>>(), py::arg("model"), py::keep_alive<1, 2>())
        .def_property_readonly_static("max_session_rows", [](py::object) { return BatchDecoder::max_session_rows; },
                                      "a session's tokens in one step")
        .def_property_readonly_static("max_step_rows", [](py::object) { return BatchDecoder::max_step_rows; },
                                      "every session's tokens in one step")
        .def("ineligible", [](const BatchDecoder & b, const Session & s) -> std::optional<std::string> {
                 std::string why = without_gil([&] {
                     const SessionLock held = s.lock(/*device =*/ false);
                     return b.ineligible(s);
                 });
                 if (why.empty()) return std::nullopt;
                 return why;
             }, py::arg("session"), "why the session cannot join a batched step (None when it can)")
        .def("step_greedy", [](BatchDecoder & b, const std::vector<Session *> & sessions, const std::vector<int32_t> & tokens,
                               const std::optional<std::vector<uint8_t>> & keep_queries) {
                 std::vector<int32_t> out;
                 without_gil([&] { b.step(sessions, tokens, &out, nullptr, keep_queries ? &*keep_queries : nullptr); });
                 return out;
             }, py::arg("sessions"), py::arg("tokens"), py::arg("keep_queries") = py::none(),
             "feed tokens[i] to sessions[i] at its n_tokens; the greedy token after each (argmax on the backend). "
             KEEP_QUERIES_DOC)
        .def("step", [](BatchDecoder & b, const std::vector<Session *> & sessions, const std::vector<int32_t> & tokens,
                        const std::optional<std::vector<uint8_t>> & keep_queries) {
                 std::vector<float> out;
                 without_gil([&] { b.step(sessions, tokens, nullptr, &out, keep_queries ? &*keep_queries : nullptr); });
                 const int64_t n = (int64_t) sessions.size(), n_vocab = (int64_t) (out.size() / (size_t) n);
                 return make_logits(std::move(out), n, n_vocab, true);
             }, py::arg("sessions"), py::arg("tokens"), py::arg("keep_queries") = py::none(),
             "feed tokens[i] to sessions[i] at its n_tokens; logits [len(sessions), n_vocab]. " KEEP_QUERIES_DOC)
        .def("step_rows", [](BatchDecoder & b, const std::vector<Session *> & sessions,
                             const std::vector<std::vector<int32_t>> & rows,
                             const std::optional<std::vector<uint8_t>> & keep_queries) {
                 std::vector<float> out;
                 without_gil([&] { b.step_rows(sessions, rows, &out, keep_queries ? &*keep_queries : nullptr); });
                 const int64_t n_vocab = sessions.empty() ? 0 : sessions.front()->model().hparams().n_vocab;
                 py::list per_session;   // each session's rows, [len(rows[i]), n_vocab]
                 size_t from = 0;
                 for (const auto & r : rows) {
                     py::array_t<float> a({(py::ssize_t) r.size(), (py::ssize_t) n_vocab});
                     std::copy_n(out.begin() + from, r.size() * (size_t) n_vocab, a.mutable_data());
                     from += r.size() * (size_t) n_vocab;
                     per_session.append(std::move(a));
                 }
                 return per_session;
             }, py::arg("sessions"), py::arg("rows"), py::arg("keep_queries") = py::none(),
             "feed rows[i] (one or more tokens: a verify step's pending token and drafts) to sessions[i] at its "
             "n_tokens; a list of each session's logits, [len(rows[i]), n_vocab] (one-token kernels on the CPU). A "
             "linear-attention state steps through every row: stash it first (Session.stash) to go back to it. "
             KEEP_QUERIES_DOC)
        .def("mtp_draft", [](BatchDecoder & b, const std::vector<Session *> & sessions, const std::vector<int32_t> & tokens,
                             int64_t step) {
                 std::vector<float> out;
                 without_gil([&] { b.mtp_draft(sessions, tokens, step, out); });
                 const int64_t n = (int64_t) sessions.size(), n_vocab = (int64_t) (out.size() / (size_t) n);
                 return make_logits(std::move(out), n, n_vocab, true);
             }, py::arg("sessions"), py::arg("tokens"), py::arg("step"),
             "draft step `step` of the multi-token-prediction head for every session, as sessions[i].mtp_draft(tokens[i], "
             "step) of each, in one graph: logits [len(sessions), n_vocab]")
        .def_property_readonly("attention_calls", &BatchDecoder::attention_calls,
                               "attention calls per layer in the last step: one per run of consecutive arena lanes, "
                               "else one per session")
        .def_property_readonly("delta_rule_calls", &BatchDecoder::delta_rule_calls,
                               "conv + delta-rule calls per linear-attention layer in the last step: one per run of "
                               "consecutive arena lanes (a step of one token a session), else one per session (0: no "
                               "such layers)")
        .def_property_readonly("compute_bytes", [](const BatchDecoder & b) { return b.compute_bytes(); },
                               "device bytes of the batched step graphs' compute buffers (decode and verify steps, draft steps)")
        .def("device_compute_bytes", [](const BatchDecoder & b, int device) {
                 if (device < 0 || device >= b.n_devices()) {
                     throw py::index_error("device " + std::to_string(device) + " of a model on " +
                                           std::to_string(b.n_devices()) + " device(s)");
                 }
                 return b.compute_bytes(device);
             }, py::arg("device"), "compute_bytes on one device of the model's (its index in Model.devices)")
        .def_property_readonly("graph_nodes", &BatchDecoder::graph_nodes, "the last step graph's nodes")
        .def_property_readonly("graph_splits", &BatchDecoder::graph_splits,
                               "the last step graph's splits in ggml's scheduler (one per run of nodes on one backend)");
}

}  // namespace kvf::bind
