#include "common/byte_io.h"

#define XXH_INLINE_ALL
#include "xxhash.h"

namespace kvf {

uint64_t snapshot_hash(const uint8_t * data, size_t n) { return XXH3_64bits(data, n); }

struct ByteWriter::HashState {
    XXH3_state_t state;
};

ByteWriter::ByteWriter(Sink sink) : sink_(std::move(sink)), hash_(std::make_unique<HashState>()) {
    XXH3_64bits_reset(&hash_->state);
}

ByteWriter::~ByteWriter() = default;

void ByteWriter::raw(const void * data, size_t n) {
    if (n == 0) return;
    sink_(static_cast<const uint8_t *>(data), n);
    XXH3_64bits_update(&hash_->state, data, n);
    written_ += (int64_t) n;
}

void ByteWriter::str(const std::string & s) {
    put<uint32_t>((uint32_t) s.size());
    raw(s.data(), s.size());
}

uint64_t ByteWriter::digest() const { return XXH3_64bits_digest(&hash_->state); }

const uint8_t * ByteReader::take(size_t n, const char * field) {
    if (n > remaining()) {
        fail(std::string("truncated: ") + field + " needs " + std::to_string(n) + " bytes, " +
             std::to_string(remaining()) + " left");
    }
    const uint8_t * p = p_;
    p_ += n;
    return p;
}

std::string ByteReader::str(const char * field, size_t max_len) {
    const uint32_t n = get<uint32_t>(field);
    if (n > max_len) fail(std::string(field) + " has length " + std::to_string(n) + " > " + std::to_string(max_len));
    const uint8_t * p = take(n, field);
    // Saved strings are names (kv types, fingerprints): ASCII. Anything else is damage, and must not
    // reach an error message, which Python decodes as UTF-8.
    for (uint32_t i = 0; i < n; ++i) {
        if (p[i] < 32 || p[i] > 126) fail(std::string(field) + " is not printable ASCII");
    }
    return std::string(reinterpret_cast<const char *>(p), n);
}

int64_t ByteReader::count(const char * field, size_t elem_bytes, int64_t lo, int64_t hi) {
    const int64_t n = get<int64_t>(field);
    if (n < lo || n > hi) {
        fail(std::string(field) + " count " + std::to_string(n) + " is outside [" + std::to_string(lo) + ", " +
             std::to_string(hi) + "]");
    }
    if (elem_bytes && (uint64_t) n > remaining() / elem_bytes) {
        fail(std::string("truncated: ") + field + " claims " + std::to_string(n) + " entries of " +
             std::to_string(elem_bytes) + " bytes, only " + std::to_string(remaining()) + " bytes left");
    }
    return n;
}

int64_t ByteReader::i64_in(const char * field, int64_t lo, int64_t hi) {
    const int64_t v = get<int64_t>(field);
    if (v < lo || v > hi) {
        fail(std::string(field) + "=" + std::to_string(v) + " is outside [" + std::to_string(lo) + ", " +
             std::to_string(hi) + "]");
    }
    return v;
}

void ByteReader::expect_end() {
    if (remaining() != 0) fail(std::to_string(remaining()) + " unexpected bytes at its end");
}

void ByteReader::fail(const std::string & msg) const { throw SnapshotError(what_ + ": " + msg); }

}  // namespace kvf
