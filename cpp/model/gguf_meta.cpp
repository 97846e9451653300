#include "model/gguf_meta.h"

#include "model/log_tap.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <stdexcept>

namespace kvf {

namespace {

constexpr uint32_t k_min_version = 2;   // gguf.cpp refuses v1 and anything past GGUF_VERSION

std::string type_of(const gguf_context * g, int64_t id) {
    const gguf_type t = gguf_get_kv_type(g, id);
    if (t != GGUF_TYPE_ARRAY) return gguf_type_name(t);
    return std::string("array of ") + gguf_type_name(gguf_get_arr_type(g, id));
}

[[noreturn]] void wrong_type(const gguf_context * g, int64_t id, const std::string & key, const char * want) {
    throw std::runtime_error("GGUF key " + key + " holds " + type_of(g, id) + ", expected " + want);
}

std::string printable(const char * p, size_t n) {
    std::string s;
    for (size_t i = 0; i < n; ++i) s += (p[i] >= 32 && p[i] < 127) ? p[i] : '?';
    return s;
}

// The header fields gguf_init_from_file would only log about.
void check_header(const std::string & path) {
    std::FILE * f = std::fopen(path.c_str(), "rb");
    if (!f) throw std::runtime_error("cannot open model file '" + path + "'");
    char head[8];
    const size_t got = std::fread(head, 1, sizeof head, f);
    std::fclose(f);
    if (got == 0) throw std::runtime_error("'" + path + "' is not a valid GGUF file (it is empty or not a regular file)");
    if (got < 4 || std::memcmp(head, "GGUF", 4) != 0) {
        throw std::runtime_error("'" + path + "' is not a valid GGUF file (it starts with '" +
                                 printable(head, got < 4 ? got : 4) + "', not 'GGUF')");
    }
    if (got < 8) throw std::runtime_error("'" + path + "' is not a valid GGUF file (it ends inside the header)");
    uint32_t version;
    std::memcpy(&version, head + 4, sizeof version);
    if (version < k_min_version || version > GGUF_VERSION) {
        throw std::runtime_error("'" + path + "' is GGUF version " + std::to_string(version) +
                                 ", which is not supported (this build reads versions " + std::to_string(k_min_version) +
                                 "-" + std::to_string(GGUF_VERSION) + ")");
    }
}

template <typename T> bool agree(const void * data, size_t n, int64_t & out) {
    const T * v = static_cast<const T *>(data);
    for (size_t i = 1; i < n; ++i) if (v[i] != v[0]) return false;
    out = (int64_t) v[0];
    return true;
}

}  // namespace

GgufFile::~GgufFile() {
    if (gguf) gguf_free(gguf);
    if (tensors) ggml_free(tensors);
}

std::unique_ptr<GgufFile> open_gguf(const std::string & path, bool with_tensors) {
    check_header(path);
    auto file = std::make_unique<GgufFile>();
    gguf_init_params gp = {/*no_alloc =*/ true, /*ctx =*/ with_tensors ? &file->tensors : nullptr};
    LogTap tap;
    file->gguf = gguf_init_from_file(path.c_str(), gp);
    if (!file->gguf) throw std::runtime_error(with_reason("'" + path + "' is not a valid GGUF file", tap));
    return file;
}

bool meta_int(const gguf_context * g, const std::string & key, int64_t lo, int64_t hi, int64_t & out) {
    const int64_t id = gguf_find_key(g, key.c_str());
    if (id < 0) return false;
    int64_t v = 0;
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_UINT8:  v = gguf_get_val_u8(g, id);  break;
        case GGUF_TYPE_INT8:   v = gguf_get_val_i8(g, id);  break;
        case GGUF_TYPE_UINT16: v = gguf_get_val_u16(g, id); break;
        case GGUF_TYPE_INT16:  v = gguf_get_val_i16(g, id); break;
        case GGUF_TYPE_UINT32: v = gguf_get_val_u32(g, id); break;
        case GGUF_TYPE_INT32:  v = gguf_get_val_i32(g, id); break;
        case GGUF_TYPE_UINT64: {
            const uint64_t u = gguf_get_val_u64(g, id);
            v = u > (uint64_t) INT64_MAX ? INT64_MAX : (int64_t) u;
            break;
        }
        case GGUF_TYPE_INT64:  v = gguf_get_val_i64(g, id); break;
        case GGUF_TYPE_ARRAY: {   // per-layer values (e.g. head_count_kv): supported when all layers agree
            const gguf_type t = gguf_get_arr_type(g, id);
            const size_t n = gguf_get_arr_n(g, id);
            if (t != GGUF_TYPE_INT32 && t != GGUF_TYPE_UINT32) wrong_type(g, id, key, "an integer");
            if (n == 0) throw std::runtime_error("GGUF key " + key + " is an empty array");
            const void * data = gguf_get_arr_data(g, id);
            const bool same = t == GGUF_TYPE_INT32 ? agree<int32_t>(data, n, v) : agree<uint32_t>(data, n, v);
            if (!same) throw std::runtime_error("GGUF key " + key + " varies per layer: unsupported");
            break;
        }
        default: wrong_type(g, id, key, "an integer");
    }
    if (v < lo || v > hi) {
        throw std::runtime_error("GGUF key " + key + " = " + std::to_string(v) + " is out of range [" +
                                 std::to_string(lo) + ", " + std::to_string(hi) + "]");
    }
    out = v;
    return true;
}

int64_t meta_require_int(const gguf_context * g, const std::string & key, int64_t lo, int64_t hi) {
    int64_t v = 0;
    if (!meta_int(g, key, lo, hi, v)) throw std::runtime_error("GGUF is missing the required key " + key);
    return v;
}

bool meta_float(const gguf_context * g, const std::string & key, float & out) {
    const int64_t id = gguf_find_key(g, key.c_str());
    if (id < 0) return false;
    double v = 0;
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_FLOAT32: v = gguf_get_val_f32(g, id); break;
        case GGUF_TYPE_FLOAT64: v = gguf_get_val_f64(g, id); break;
        default: wrong_type(g, id, key, "a float");
    }
    if (!std::isfinite((float) v)) {
        throw std::runtime_error("GGUF key " + key + " = " + std::to_string(v) + " is not a finite float32");
    }
    out = (float) v;
    return true;
}

bool meta_str(const gguf_context * g, const std::string & key, std::string & out) {
    const int64_t id = gguf_find_key(g, key.c_str());
    if (id < 0) return false;
    if (gguf_get_kv_type(g, id) != GGUF_TYPE_STRING) wrong_type(g, id, key, "a string");
    out = gguf_get_val_str(g, id);
    return true;
}

bool meta_bool(const gguf_context * g, const std::string & key, bool & out) {
    const int64_t id = gguf_find_key(g, key.c_str());
    if (id < 0) return false;
    if (gguf_get_kv_type(g, id) != GGUF_TYPE_BOOL) wrong_type(g, id, key, "a bool");
    out = gguf_get_val_bool(g, id);
    return true;
}

bool meta_array_n(const gguf_context * g, const std::string & key, gguf_type elem, int64_t & n) {
    const int64_t id = gguf_find_key(g, key.c_str());
    if (id < 0) return false;
    if (gguf_get_kv_type(g, id) != GGUF_TYPE_ARRAY || gguf_get_arr_type(g, id) != elem) {
        wrong_type(g, id, key, (std::string("an array of ") + gguf_type_name(elem)).c_str());
    }
    n = (int64_t) gguf_get_arr_n(g, id);
    return true;
}

bool meta_bool_array(const gguf_context * g, const std::string & key, int64_t n, std::vector<uint8_t> & out) {
    int64_t have = 0;
    if (!meta_array_n(g, key, GGUF_TYPE_BOOL, have)) return false;
    if (have != n) {
        throw std::runtime_error("GGUF key " + key + " has " + std::to_string(have) + " entries, expected " + std::to_string(n));
    }
    const auto * data = static_cast<const int8_t *>(gguf_get_arr_data(g, gguf_find_key(g, key.c_str())));
    out.assign((size_t) n, 0);
    for (int64_t i = 0; i < n; ++i) out[(size_t) i] = data[i] != 0;
    return true;
}

bool meta_int_array(const gguf_context * g, const std::string & key, int64_t n, int64_t lo, int64_t hi,
                    std::vector<int64_t> & out) {
    const int64_t id = gguf_find_key(g, key.c_str());
    if (id < 0) return false;
    if (gguf_get_kv_type(g, id) != GGUF_TYPE_ARRAY ||
        (gguf_get_arr_type(g, id) != GGUF_TYPE_INT32 && gguf_get_arr_type(g, id) != GGUF_TYPE_UINT32)) {
        wrong_type(g, id, key, "an array of 32-bit integers");
    }
    const int64_t have = (int64_t) gguf_get_arr_n(g, id);
    if (have != n) {
        throw std::runtime_error("GGUF key " + key + " has " + std::to_string(have) + " entries, expected " + std::to_string(n));
    }
    const void * data = gguf_get_arr_data(g, id);
    const bool is_signed = gguf_get_arr_type(g, id) == GGUF_TYPE_INT32;
    out.assign((size_t) n, 0);
    for (int64_t i = 0; i < n; ++i) {
        const int64_t v = is_signed ? (int64_t) static_cast<const int32_t *>(data)[i] : (int64_t) static_cast<const uint32_t *>(data)[i];
        if (v < lo || v > hi) {
            throw std::runtime_error("GGUF key " + key + "[" + std::to_string(i) + "] = " + std::to_string(v) +
                                     " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
        }
        out[(size_t) i] = v;
    }
    return true;
}

}  // namespace kvf
