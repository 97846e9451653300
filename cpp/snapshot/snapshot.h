// Snapshots: a Session's whole state in one checksummed file, restorable in this or another process
// without running the model again. Each piece writes its own versioned section (Session: config and
// token count; KvPager: the ledger; PooledKV: the layout and every chunk's K/V image); this module
// adds the container, the model fingerprint and the token history, and does all file handling.
//
// Container, format version 1 (little-endian):
//   "KVFSNAP\0"  u32 format_version  u32 n_sections
//   n_sections x { u32 tag (4 ASCII chars)  u32 section_version  u64 length  payload }
//   u64 XXH3-64 of every byte before it
// Sections of version 1, each at most once: MODL (model fingerprint), SESS (Session), TOKS (token
// history, i32 array), PAGR (KvPager), SUMM (ChunkSummaries: only when the session tracks them, so qk and
// quest are warm after a restore), KVIM (PooledKV; written last, streamed). All but SUMM are required.
// Format version 2 adds RING (SlidingWindowKV: the sliding-window layers' rings), present exactly when the
// model has such layers; files without it are still written as version 1. Format version 3 adds RCUR
// (RecurrentState: the linear-attention layers' conv and recurrent state), present exactly when the model
// has such layers; it exists only for everything the session consumed, so a prefix snapshot of a hybrid
// model is refused.
// A new section comes with a format version bump; readers refuse versions and tags they do not know.
// A session that tracks summaries, loading a snapshot without them, drops its own (scores NaN until
// chunks are sealed again); one that does not track them ignores SUMM.
//
// Restore puts every resident chunk back in the block it was saved from, so a continuation computes in
// exactly the same slot order as the session that was saved (results are bit-identical; with quantized
// KV, attention sums in slot order). Evicted chunks go back to the host store.
//
// Errors: SnapshotError naming the reason for anything wrong with the bytes or their fit to the session;
// SnapshotIOError (an OSError in Python) when a file cannot be read or written. Loading validates the
// whole file before it changes anything; saving writes a temporary file and renames it into place.
// Only regular files are read or replaced: a path naming a directory, a FIFO, a device node or a socket is
// refused by name (a rename would turn a device node into a regular file; opening a FIFO would wait for a
// writer), and so is saving to a symbolic link (the rename would replace the link, and writing through it
// would let whoever placed the link choose which file is overwritten).
#pragma once

#include "runtime/session.h"
#include "common/byte_io.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kvf {

class SnapshotIOError : public SnapshotError {
public:
    SnapshotIOError(const std::string & msg, int err, std::string path, std::string reason = "")
        : SnapshotError(msg), err(err), path(std::move(path)), reason(std::move(reason)) {}
    int err;            // errno
    std::string path;
    std::string reason;   // what OSError shows instead of strerror(err) when the errno alone misleads ("" = strerror)
};

constexpr uint32_t k_snapshot_format_version = 3;   // the newest this build reads (2 adds RING, 3 RCUR)

// prefix_chunks < 0: everything the session holds; else only the first prefix_chunks chunks, with the
// ledger the session would have after truncating to them (the live session is not touched).
std::vector<uint8_t> snapshot_to_bytes(const Session & s, int64_t prefix_chunks = -1);
void snapshot_to_file(const Session & s, const std::string & path, int64_t prefix_chunks = -1);

// A snapshot file's bytes for a load: the file mapped read-only, so a restore holds no second copy of it (its pages
// are the page cache's, which the kernel drops again under pressure; a 1M-token q8_0 snapshot is 68 GiB), or read
// into memory where the file system cannot map it. The mapping is of the file opened and checked: a file renamed
// over it meanwhile (as every save does) does not change it. A file truncated in place by another process while
// it is mapped ends this one with SIGBUS, as a GGUF truncated under llama.cpp's mmap does: snapshots are only ever
// replaced by renaming, never rewritten in place.
class SnapshotFile {
public:
    explicit SnapshotFile(const std::string & path);   // SnapshotIOError if it cannot be opened, is not a regular file
    ~SnapshotFile();
    SnapshotFile(const SnapshotFile &) = delete;
    SnapshotFile & operator=(const SnapshotFile &) = delete;
    const uint8_t * data() const { return map_ ? static_cast<const uint8_t *>(map_) : read_.data(); }
    size_t size() const { return size_; }
    bool mapped() const { return map_ != nullptr; }

private:
    void * map_ = nullptr;
    size_t size_ = 0;
    std::vector<uint8_t> read_;   // where mmap is refused
};

// Load into an existing session (same model, same kv_type and chunk size; the pool and context may
// differ where the saved state fits). On any error the session is unchanged.
void snapshot_load(Session & s, const uint8_t * data, size_t size);
// A new session with the saved config, holding the saved state. The saved config decides what the new
// session allocates (its pager's chunk table, its pool), so it is bounded before anything is allocated:
// the context (max_tokens) by `max_tokens` (<= 0: the model's trained context, whatever the saved
// allow_beyond_train_ctx says: a file cannot raise the limit, only the caller can), the pool by that
// context. A file asking for more is refused with SnapshotError.
std::unique_ptr<Session> snapshot_restore(std::shared_ptr<Model> model, const uint8_t * data, size_t size,
                                          int64_t max_tokens = 0);

struct SnapshotInfo {
    uint32_t format_version = 0;
    std::string fingerprint;
    SessionConfig config;
    int64_t n_tokens = 0;
};
SnapshotInfo snapshot_info(const uint8_t * data, size_t size);   // checks the container and checksum

uint64_t snapshot_checksum(const uint8_t * data, size_t size);   // what the trailer of such bytes must hold

}  // namespace kvf
