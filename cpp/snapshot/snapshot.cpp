#include "snapshot/snapshot.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>

namespace kvf {

namespace {

constexpr char k_magic[8] = {'K', 'V', 'F', 'S', 'N', 'A', 'P', '\0'};
constexpr size_t k_header_bytes = 16;    // magic, format version, section count
constexpr size_t k_trailer_bytes = 8;    // checksum
constexpr uint32_t k_max_sections = 64;  // v1 has 5; a bound so a corrupt count cannot loop long
constexpr uint32_t k_modl_version = 1;
constexpr uint32_t k_toks_version = 1;

constexpr uint32_t tag_of(const char (&s)[5]) {
    return (uint32_t) (uint8_t) s[0] | (uint32_t) (uint8_t) s[1] << 8 | (uint32_t) (uint8_t) s[2] << 16 |
           (uint32_t) (uint8_t) s[3] << 24;
}
constexpr uint32_t k_modl = tag_of("MODL"), k_sess = tag_of("SESS"), k_toks = tag_of("TOKS"),
                   k_pagr = tag_of("PAGR"), k_summ = tag_of("SUMM"), k_kvim = tag_of("KVIM"), k_ring = tag_of("RING"),
                   k_rcur = tag_of("RCUR");

std::string tag_name(uint32_t t) {
    std::string s = "'";
    for (int i = 0; i < 4; ++i) {
        const char c = (char) (t >> (8 * i));
        s += (c >= 32 && c < 127) ? c : '?';
    }
    return s + "'";
}

struct Section {
    bool present = false;
    uint32_t version = 0;
    const uint8_t * data = nullptr;
    size_t size = 0;
};

// Everything of a snapshot that is not the pager ledger and the KV images (those are read against the
// session they go into).
struct Parsed {
    uint32_t format_version = 0;   // the file's own
    std::string fingerprint;
    SessionConfig config;
    int64_t n_tokens = 0;
    std::vector<int32_t> tokens;
    Section pager, summaries, kv, ring, recurrent;
};

std::map<uint32_t, Section> read_container(const uint8_t * data, size_t size, uint32_t & format_version) {
    if (size < k_header_bytes + k_trailer_bytes) {
        throw SnapshotError("truncated: " + std::to_string(size) + " bytes is less than a snapshot header and checksum");
    }
    if (std::memcmp(data, k_magic, sizeof k_magic) != 0) throw SnapshotError("not a kvflash snapshot (bad magic)");
    ByteReader head(data + sizeof k_magic, k_header_bytes - sizeof k_magic, "snapshot header");
    const uint32_t version = format_version = head.get<uint32_t>("format_version");
    if (version < 1 || version > k_snapshot_format_version) {
        throw SnapshotError("snapshot format version " + std::to_string(version) + " is not supported (this build reads 1 to " +
                            std::to_string(k_snapshot_format_version) + ")");
    }
    uint64_t stored;
    std::memcpy(&stored, data + size - k_trailer_bytes, sizeof stored);
    if (stored != snapshot_hash(data, size - k_trailer_bytes)) {
        throw SnapshotError("checksum mismatch: the snapshot is corrupt or truncated");
    }
    const uint32_t n_sections = head.get<uint32_t>("n_sections");
    if (n_sections > k_max_sections) throw SnapshotError("snapshot header: " + std::to_string(n_sections) + " sections");
    ByteReader body(data + k_header_bytes, size - k_header_bytes - k_trailer_bytes, "snapshot");
    std::map<uint32_t, Section> sections;
    for (uint32_t i = 0; i < n_sections; ++i) {
        const uint32_t tag = body.get<uint32_t>("section tag");
        Section s;
        s.present = true;
        s.version = body.get<uint32_t>("section version");
        const uint64_t length = body.get<uint64_t>("section length");
        if (length > body.remaining()) body.fail("truncated: section " + tag_name(tag) + " runs past the end");
        s.size = (size_t) length;
        s.data = body.take(s.size, "section");
        const bool known = tag == k_modl || tag == k_sess || tag == k_toks || tag == k_pagr || tag == k_summ ||
                           tag == k_kvim || (tag == k_ring && version >= 2) || (tag == k_rcur && version >= 3);
        if (!known) {
            body.fail("unknown section " + tag_name(tag));
        }
        if (!sections.emplace(tag, s).second) body.fail("section " + tag_name(tag) + " appears twice");
    }
    body.expect_end();
    for (uint32_t tag : {k_modl, k_sess, k_toks, k_pagr, k_kvim}) {
        if (!sections.count(tag)) throw SnapshotError("snapshot: section " + tag_name(tag) + " is missing");
    }
    return sections;
}

void check_version(ByteReader & r, uint32_t version, uint32_t supported) {
    if (version != supported) {
        r.fail("version " + std::to_string(version) + " is not supported (this build reads " +
               std::to_string(supported) + ")");
    }
}

Parsed parse(const uint8_t * data, size_t size) {
    Parsed p;
    std::map<uint32_t, Section> sections = read_container(data, size, p.format_version);
    const Section & modl = sections[k_modl];
    ByteReader mr(modl.data, modl.size, "model section");
    check_version(mr, modl.version, k_modl_version);
    p.fingerprint = mr.str("fingerprint", 4096);
    mr.expect_end();

    const Section & sess = sections[k_sess];
    ByteReader sr(sess.data, sess.size, "session section");
    p.config = Session::config_from(sr, sess.version, p.n_tokens);
    sr.expect_end();

    const Section & toks = sections[k_toks];
    ByteReader tr(toks.data, toks.size, "token section");
    check_version(tr, toks.version, k_toks_version);
    p.tokens = tr.array<int32_t>("tokens", p.n_tokens);
    if ((int64_t) p.tokens.size() != p.n_tokens) {
        tr.fail("holds " + std::to_string(p.tokens.size()) + " tokens, the session section says " +
                std::to_string(p.n_tokens));
    }
    tr.expect_end();
    p.pager = sections[k_pagr];
    p.summaries = sections[k_summ];   // optional: present when the saved session tracked summaries
    p.kv = sections[k_kvim];
    p.ring = sections[k_ring];   // present when the saved model has sliding-window layers
    p.recurrent = sections[k_rcur];   // ... and linear-attention layers
    return p;
}

void check_model(const Model & model, const Parsed & p) {
    const std::string ours = model.fingerprint();
    if (p.fingerprint != ours) {
        throw SnapshotError("the snapshot was made with another model (saved fingerprint " + p.fingerprint +
                            ", this model " + ours + ")");
    }
}

void load_parsed(Session & s, const Parsed & p) {
    const SessionLock held = s.lock();   // validated against, and committed to, the state no thread changes
    check_model(s.model(), p);
    const SessionConfig & c = s.config();
    if (p.config.kv_type != c.kv_type) {
        throw SnapshotError("the snapshot was saved with kv_type=" + p.config.kv_type + " but this session uses kv_type=" +
                            c.kv_type);
    }
    if (p.config.mtp != c.mtp) {   // the head's K/V are a layer of the pool and its carry part of the state
        throw SnapshotError(std::string("the snapshot was saved by a session ") + (p.config.mtp ? "with" : "without") +
                            " the multi-token-prediction head, and this session runs " + (c.mtp ? "it" : "none"));
    }
    if (p.config.chunk_tokens != c.chunk_tokens) {
        throw SnapshotError("the snapshot was saved with chunk_tokens=" + std::to_string(p.config.chunk_tokens) +
                            " but this session uses chunk_tokens=" + std::to_string(c.chunk_tokens));
    }
    const int64_t n_vocab = s.model().hparams().n_vocab;
    for (int32_t t : p.tokens) {
        if (t < 0 || t >= n_vocab) {
            throw SnapshotError("token section: token id " + std::to_string(t) + " is outside the vocabulary [0, " +
                                std::to_string(n_vocab) + ")");
        }
    }
    ByteReader pr(p.pager.data, p.pager.size, "pager section");
    KvPager ledger = s.pager().state_from(pr, p.pager.version);
    pr.expect_end();
    if (ledger.n_tokens() != p.n_tokens) {
        pr.fail("holds " + std::to_string(ledger.n_tokens()) + " tokens, the session section says " +
                std::to_string(p.n_tokens));
    }
    if (s.full_cache() && ledger.n_resident() < ledger.n_chunks()) {
        throw SnapshotError("the snapshot has " + std::to_string(ledger.n_chunks() - ledger.n_resident()) +
                            " chunks only in host memory, and a full-cache session pages nothing in: restore it "
                            "into a pooled session");
    }
    ByteReader kr(p.kv.data, p.kv.size, "KV section");
    const std::vector<const uint8_t *> images = s.kv().state_from(kr, p.kv.version, ledger.n_chunks());
    kr.expect_end();
    std::unique_ptr<ChunkSummaries> summaries;
    if (p.summaries.present && s.summaries()) {
        ByteReader r(p.summaries.data, p.summaries.size, "summary section");
        const int64_t n_sealed = ledger.n_tokens() / ledger.config().chunk_tokens;
        summaries = std::make_unique<ChunkSummaries>(s.summaries()->state_from(r, p.summaries.version, n_sealed));
        r.expect_end();
    }
    std::unique_ptr<SlidingWindowKV::Saved> ring;
    if (s.ring()) {
        if (!p.ring.present) throw SnapshotError("snapshot: section 'RING' (the sliding-window layers) is missing");
        ByteReader r(p.ring.data, p.ring.size, "ring section");
        ring = std::make_unique<SlidingWindowKV::Saved>(s.ring()->state_from(r, p.ring.version, ledger.n_tokens()));
        r.expect_end();
    } else if (p.ring.present) {
        throw SnapshotError("the snapshot has sliding-window rings but this model has no sliding-window layers");
    }
    std::unique_ptr<RecurrentState::Copy> recurrent;
    if (s.recurrent()) {
        if (!p.recurrent.present) throw SnapshotError("snapshot: section 'RCUR' (the linear-attention layers' state) is missing");
        ByteReader r(p.recurrent.data, p.recurrent.size, "recurrent-state section");
        recurrent = std::make_unique<RecurrentState::Copy>(s.recurrent()->state_from(r, p.recurrent.version, ledger.n_tokens()));
        r.expect_end();
    } else if (p.recurrent.present) {
        throw SnapshotError("the snapshot has a linear-attention state but this model has no linear-attention layers");
    }
    s.restore_state(std::move(ledger), images, p.tokens, std::move(summaries), ring.get(), recurrent.get());
}

void write_section(ByteWriter & w, uint32_t tag, uint32_t version, const std::function<void(ByteWriter &)> & body) {
    VectorWriter v;
    body(v.w);
    w.put<uint32_t>(tag);
    w.put<uint32_t>(version);
    w.put<uint64_t>((uint64_t) v.bytes.size());
    w.raw(v.bytes.data(), v.bytes.size());
}

int64_t saved_tokens(const Session & s, int64_t prefix_chunks) {
    const int64_t n = s.pager().n_tokens();
    if (prefix_chunks < 0) return n;
    const int64_t ct = s.pager().config().chunk_tokens;
    if (prefix_chunks > n / ct) {
        throw SnapshotError("a prefix of " + std::to_string(prefix_chunks) + " chunks needs " +
                            std::to_string(prefix_chunks * ct) + " tokens; the session holds " + std::to_string(n) +
                            " (" + std::to_string(n / ct) + " whole chunks)");
    }
    return prefix_chunks * ct;
}

void write_snapshot(const Session & s, int64_t prefix_chunks, ByteWriter & w) {
    const KvPager & live = s.pager();
    const int64_t n_tokens = saved_tokens(s, prefix_chunks);
    if ((int64_t) s.tokens().size() != live.n_tokens()) throw std::logic_error("session tokens out of step with its pager");
    // A prefix is saved with the ledger truncation would leave; the bytes of its chunks are the live ones.
    KvPager ledger = live;
    if (n_tokens < live.n_tokens()) ledger.apply(ledger.plan_truncate(n_tokens));
    std::vector<int64_t> sources = live.chunk_blocks();
    sources.resize((size_t) ledger.n_chunks());
    const std::vector<int32_t> tokens(s.tokens().begin(), s.tokens().begin() + n_tokens);

    const SlidingWindowKV * ring = s.ring();
    const RecurrentState * recurrent = s.recurrent();
    w.raw(k_magic, sizeof k_magic);
    // The oldest version that has every section written, so older builds keep reading what they can.
    w.put<uint32_t>(recurrent ? 3 : ring ? 2 : 1);
    w.put<uint32_t>(5 + (s.summaries() ? 1 : 0) + (ring ? 1 : 0) + (recurrent ? 1 : 0));
    write_section(w, k_modl, k_modl_version, [&](ByteWriter & o) { o.str(s.model().fingerprint()); });
    write_section(w, k_sess, Session::k_state_version, [&](ByteWriter & o) { s.save_state(o, n_tokens); });
    write_section(w, k_toks, k_toks_version, [&](ByteWriter & o) { o.array(tokens); });
    write_section(w, k_pagr, KvPager::k_state_version, [&](ByteWriter & o) { ledger.save_state(o); });
    if (const ChunkSummaries * cs = s.summaries()) {
        write_section(w, k_summ, ChunkSummaries::k_state_version, [&](ByteWriter & o) {
            cs->save_state(o, ledger.n_chunks());
        });
    }
    if (ring) {
        write_section(w, k_ring, SlidingWindowKV::k_state_version, [&](ByteWriter & o) { ring->save_state(o, n_tokens); });
    }
    if (recurrent) {
        write_section(w, k_rcur, RecurrentState::k_state_version, [&](ByteWriter & o) { recurrent->save_state(o, n_tokens); });
    }
    // The KV images are most of the file: streamed straight out rather than staged.
    const int64_t kv_bytes = s.kv().state_bytes(ledger.n_chunks());
    w.put<uint32_t>(k_kvim);
    w.put<uint32_t>(PooledKV::k_state_version);
    w.put<uint64_t>((uint64_t) kv_bytes);
    const int64_t before = w.written();
    s.kv().save_state(w, sources);
    s.model().check_rpc_connections();   // before the digest: a lost device's K/V read as zeros
    if (w.written() - before != kv_bytes) throw std::logic_error("PooledKV::state_bytes disagrees with save_state");
    w.put<uint64_t>(w.digest());
}

[[noreturn]] void io_fail(const std::string & what, const std::string & path) {
    const int err = errno;
    throw SnapshotIOError(what + " " + path + ": " + std::strerror(err), err, path);
}

// Refused by name rather than by a bare errno: `reason` is what OSError shows.
[[noreturn]] void refuse(const std::string & path, int err, const std::string & reason) {
    throw SnapshotIOError(path + ": " + reason, err, path, reason);
}

const char * file_kind(mode_t mode) {
    if (S_ISDIR(mode)) return "a directory";
    if (S_ISLNK(mode)) return "a symbolic link";
    if (S_ISFIFO(mode)) return "a FIFO";
    if (S_ISCHR(mode)) return "a character device";
    if (S_ISBLK(mode)) return "a block device";
    if (S_ISSOCK(mode)) return "a socket";
    return "a special file";
}

// A snapshot replaces only a regular file, or creates one (snapshot.h says why). lstat: a link is not followed.
void check_save_destination(const std::string & path) {
    struct stat st;
    if (lstat(path.c_str(), &st) != 0) {
        if (errno == ENOENT) return;
        io_fail("cannot stat", path);
    }
    if (S_ISREG(st.st_mode)) return;
    if (S_ISDIR(st.st_mode)) refuse(path, EISDIR, "is a directory, not a snapshot file");
    refuse(path, EEXIST, std::string("exists and is not a regular file (") + file_kind(st.st_mode) +
                             "): a snapshot replaces only a regular file" +
                             (S_ISLNK(st.st_mode) ? "; give the path of the file itself" : ""));
}

// What a load reads from must be a regular file: checked before opening (opening a device can act on it), and
// opened without blocking (a FIFO made meanwhile would otherwise wait for a writer).
void check_load_source(const std::string & path, const struct stat & st) {
    if (S_ISREG(st.st_mode)) return;
    if (S_ISDIR(st.st_mode)) refuse(path, EISDIR, "is a directory, not a snapshot file");
    refuse(path, EINVAL, std::string("not a regular file (") + file_kind(st.st_mode) + "), not a snapshot file");
}

// The temporary file beside `path`, created afresh (O_EXCL: never through a file or link already there, and
// two saves to one path in this process never share one); its name goes to `tmp`.
FILE * create_temp(const std::string & path, std::string & tmp) {
    for (int attempt = 0; attempt < 100; ++attempt) {
        tmp = path + ".tmp" + std::to_string(getpid()) + (attempt ? "." + std::to_string(attempt) : "");
        const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        if (fd < 0) {
            if (errno == EEXIST) continue;
            io_fail("cannot create", tmp);
        }
        FILE * f = fdopen(fd, "wb");
        if (!f) {
            const int err = errno;
            close(fd);
            unlink(tmp.c_str());
            errno = err;
            io_fail("cannot create", tmp);
        }
        return f;
    }
    io_fail("cannot create", tmp);   // errno EEXIST
}

}  // namespace

std::vector<uint8_t> snapshot_to_bytes(const Session & s, int64_t prefix_chunks) {
    const SessionLock held = s.lock();   // K/V read from the pool: no forward may run meanwhile
    std::vector<uint8_t> out;
    out.reserve((size_t) s.kv().state_bytes(s.pager().n_chunks()) + s.tokens().size() * 4 + (1 << 16));
    ByteWriter w([&](const uint8_t * p, size_t n) { out.insert(out.end(), p, p + n); });
    write_snapshot(s, prefix_chunks, w);
    return out;
}

void snapshot_to_file(const Session & s, const std::string & path, int64_t prefix_chunks) {
    const SessionLock held = s.lock();
    saved_tokens(s, prefix_chunks);   // a bad prefix fails before any file exists
    check_save_destination(path);
    // Written beside the target and renamed over it: a failure leaves any previous file intact.
    std::string tmp;
    FILE * f = create_temp(path, tmp);
    try {
        ByteWriter w([&](const uint8_t * p, size_t n) {
            if (std::fwrite(p, 1, n, f) != n) io_fail("cannot write", tmp);
        });
        write_snapshot(s, prefix_chunks, w);
        if (std::fflush(f) != 0 || fsync(fileno(f)) != 0) io_fail("cannot write", tmp);
    } catch (...) {
        std::fclose(f);
        std::remove(tmp.c_str());
        throw;
    }
    if (std::fclose(f) != 0) {
        std::remove(tmp.c_str());
        io_fail("cannot write", tmp);
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0) {
        const int err = errno;
        std::remove(tmp.c_str());
        errno = err;
        io_fail("cannot rename the snapshot into", path);
    }
}

SnapshotFile::SnapshotFile(const std::string & path) {
    struct stat st;
    if (stat(path.c_str(), &st) != 0) io_fail("cannot open", path);
    check_load_source(path, st);
    const int fd = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) io_fail("cannot open", path);
    const auto fail = [&](const char * what) {
        const int err = errno;
        close(fd);
        errno = err;
        io_fail(what, path);
    };
    if (fstat(fd, &st) != 0) fail("cannot stat");
    try {
        check_load_source(path, st);   // the file opened is the one checked
    } catch (...) {
        close(fd);
        throw;
    }
    size_ = (size_t) st.st_size;
    if (size_ == 0) {   // nothing to map (mmap refuses 0 bytes): the parse reports it truncated
        close(fd);
        return;
    }
    void * p = mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p != MAP_FAILED) {
        map_ = p;
        close(fd);   // the mapping keeps the file
        return;
    }
    read_.resize(size_);
    size_t got = 0;
    while (got < size_) {
        const ssize_t n = read(fd, read_.data() + got, size_ - got);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) fail("cannot read");
        if (n == 0) break;   // a file that shrank while being read is then reported as truncated
        got += (size_t) n;
    }
    close(fd);
    read_.resize(got);
    size_ = got;
}

SnapshotFile::~SnapshotFile() {
    if (map_) munmap(map_, size_);
}

void snapshot_load(Session & s, const uint8_t * data, size_t size) { load_parsed(s, parse(data, size)); }

namespace {

// What a restore may allocate for the saved config, checked before it allocates anything.
void check_restore_size(const Model & model, const SessionConfig & c, int64_t max_tokens) {
    const int64_t n_ctx_train = model.hparams().n_ctx_train;
    const int64_t limit = max_tokens > 0 ? max_tokens : n_ctx_train;
    if (c.max_tokens > limit) {
        throw SnapshotError("the snapshot asks for a session of max_tokens=" + std::to_string(c.max_tokens) +
                            "; a restore allows at most " + std::to_string(limit) +
                            (max_tokens > 0 ? std::string(" (max_tokens)")
                                            : " (the model's trained context; pass max_tokens to allow more)"));
    }
    // A pool never needs more slots than the context rounded up to whole chunks and kv padding (a full
    // cache is sized so); a larger one would only be allocated to sit empty.
    const int64_t ct = c.chunk_tokens;
    const int64_t pool_limit = std::max((c.max_tokens + 255) / 256 * 256, (c.sink_chunks + c.tail_chunks + 2) * ct);
    if (c.pool_tokens > pool_limit) {
        throw SnapshotError("the snapshot asks for pool_tokens=" + std::to_string(c.pool_tokens) +
                            ", more than its context of max_tokens=" + std::to_string(c.max_tokens) + " can use");
    }
}

}  // namespace

std::unique_ptr<Session> snapshot_restore(std::shared_ptr<Model> model, const uint8_t * data, size_t size,
                                          int64_t max_tokens) {
    const Parsed p = parse(data, size);
    check_model(*model, p);
    // The pool the saved config asks for must be the one the ledger describes, before anything is
    // allocated for it (the ledger's config starts with chunk_tokens, pool_tokens, max_tokens).
    ByteReader pr(p.pager.data, p.pager.size, "pager section");
    const int64_t chunk_tokens = pr.get<int64_t>("config"), pool_tokens = pr.get<int64_t>("config"),
                  max_tokens_saved = pr.get<int64_t>("config");
    if (chunk_tokens != p.config.chunk_tokens || max_tokens_saved != p.config.max_tokens ||
        (p.config.pool_tokens != 0 && pool_tokens != p.config.pool_tokens)) {
        pr.fail("its geometry (chunk_tokens, pool_tokens, max_tokens) disagrees with the session section");
    }
    check_restore_size(*model, p.config, max_tokens);
    std::unique_ptr<Session> s;
    try {
        s = std::make_unique<Session>(std::move(model), p.config);
    } catch (const std::invalid_argument & e) {
        throw SnapshotError(std::string("the saved session config does not work with this model: ") + e.what());
    }
    load_parsed(*s, p);
    return s;
}

SnapshotInfo snapshot_info(const uint8_t * data, size_t size) {
    Parsed p = parse(data, size);
    return SnapshotInfo{p.format_version, p.fingerprint, p.config, p.n_tokens};
}

uint64_t snapshot_checksum(const uint8_t * data, size_t size) {
    return size < k_trailer_bytes ? 0 : snapshot_hash(data, size - k_trailer_bytes);
}

}  // namespace kvf
