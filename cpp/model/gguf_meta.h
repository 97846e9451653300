// Opening GGUF files and reading their metadata without ever aborting the process.
//
// ggml's gguf_get_val_* GGML_ASSERT (abort) when a key holds another type than the one asked for, and
// gguf_init_from_file only logs why it refused a file. So the header (magic, version) is read here
// first, gguf's own refusal reason is tapped from the log, and every metadata read checks the stored
// type, then the range (integers) or finiteness (floats), and throws std::runtime_error naming the key.
#pragma once

#include "ggml.h"
#include "gguf.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kvf {

struct GgufFile {
    GgufFile() = default;
    ~GgufFile();
    GgufFile(const GgufFile &) = delete;
    GgufFile & operator=(const GgufFile &) = delete;
    gguf_context * gguf = nullptr;
    ggml_context * tensors = nullptr;   // tensor metadata (no data); only when opened with_tensors
};

// Throws std::runtime_error naming the reason: missing file, not GGUF, unsupported version, malformed.
std::unique_ptr<GgufFile> open_gguf(const std::string & path, bool with_tensors);

// Any integer type (as llama.cpp accepts) or a per-layer INT32/UINT32 array whose entries all agree.
// false when the key is absent; throws when it has another type or lies outside [lo, hi].
bool meta_int(const gguf_context * g, const std::string & key, int64_t lo, int64_t hi, int64_t & out);
int64_t meta_require_int(const gguf_context * g, const std::string & key, int64_t lo, int64_t hi);
// FLOAT32 or FLOAT64, and finite.
bool meta_float(const gguf_context * g, const std::string & key, float & out);
bool meta_str(const gguf_context * g, const std::string & key, std::string & out);
bool meta_bool(const gguf_context * g, const std::string & key, bool & out);
// The element count of an array key of element type `elem`; throws if the key holds anything else.
bool meta_array_n(const gguf_context * g, const std::string & key, gguf_type elem, int64_t & n);
// A BOOL array of exactly n entries (per-layer flags); throws if the key holds anything else.
bool meta_bool_array(const gguf_context * g, const std::string & key, int64_t n, std::vector<uint8_t> & out);
// An INT32/UINT32 array of exactly n entries, each in [lo, hi]; throws if the key holds anything else.
bool meta_int_array(const gguf_context * g, const std::string & key, int64_t n, int64_t lo, int64_t hi,
                    std::vector<int64_t> & out);

}  // namespace kvf
