// Byte-level reading and writing for snapshots. Pure C++ (no ggml), so the pager can use it.
//
// Values are written in the host's byte order, which must be little-endian (checked at compile time):
// every platform ggml runs on is. ByteWriter hashes everything it writes (XXH3-64, from the xxHash copy
// vendored in the pinned llama.cpp tree) so a file can be sealed with a checksum while it streams out.
// ByteReader checks every read against the bytes it has and throws SnapshotError naming what was being
// read, so no length or count taken from a file can make it read outside its buffer or allocate more
// than the file could possibly describe.
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "snapshots are written little-endian");

namespace kvf {

// Every reason a snapshot cannot be written or loaded (the message names it). Python sees ValueError.
class SnapshotError : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

uint64_t snapshot_hash(const uint8_t * data, size_t n);   // XXH3-64 with seed 0

class ByteWriter {
public:
    using Sink = std::function<void(const uint8_t *, size_t)>;
    explicit ByteWriter(Sink sink);
    ~ByteWriter();
    ByteWriter(const ByteWriter &) = delete;
    ByteWriter & operator=(const ByteWriter &) = delete;

    void raw(const void * data, size_t n);
    template <typename T> void put(T v) { raw(&v, sizeof v); }   // T: an arithmetic type
    void str(const std::string & s);                            // u32 length + bytes
    template <typename T> void array(const std::vector<T> & v) { // i64 count + elements
        put<int64_t>((int64_t) v.size());
        if (!v.empty()) raw(v.data(), v.size() * sizeof(T));
    }

    uint64_t digest() const;          // hash of every byte written so far
    int64_t written() const { return written_; }

private:
    Sink sink_;
    struct HashState;
    std::unique_ptr<HashState> hash_;
    int64_t written_ = 0;
};

// A writer into a growing vector (for small sections that must be measured before they are written).
struct VectorWriter {
    std::vector<uint8_t> bytes;
    ByteWriter w{[this](const uint8_t * p, size_t n) { bytes.insert(bytes.end(), p, p + n); }};
};

class ByteReader {
public:
    ByteReader(const uint8_t * data, size_t size, std::string what) : p_(data), end_(data + size), what_(std::move(what)) {}

    size_t remaining() const { return (size_t) (end_ - p_); }
    const uint8_t * take(size_t n, const char * field);   // pointer to the next n bytes, then skips them
    template <typename T> T get(const char * field) {
        T v;
        std::memcpy(&v, take(sizeof v, field), sizeof v);
        return v;
    }
    std::string str(const char * field, size_t max_len);   // printable ASCII only
    // An element count that must fit in what is left (elem_bytes each) and in [lo, hi].
    int64_t count(const char * field, size_t elem_bytes, int64_t lo = 0, int64_t hi = INT64_MAX);
    template <typename T> std::vector<T> array(const char * field, int64_t hi = INT64_MAX) {
        const int64_t n = count(field, sizeof(T), 0, hi);
        std::vector<T> v((size_t) n);
        if (n) std::memcpy(v.data(), take((size_t) n * sizeof(T), field), (size_t) n * sizeof(T));
        return v;
    }
    // An integer field that must lie in [lo, hi].
    int64_t i64_in(const char * field, int64_t lo, int64_t hi);
    void expect_end();   // the section must be consumed exactly
    [[noreturn]] void fail(const std::string & msg) const;

private:
    const uint8_t * p_;
    const uint8_t * end_;
    std::string what_;   // e.g. "pager section": prefixes every error
};

}  // namespace kvf
