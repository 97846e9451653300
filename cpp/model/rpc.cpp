#include "model/rpc.h"

#include "model/backends.h"

#ifdef KVFLASH_RPC
#include "ggml-rpc.h"
#endif

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>

namespace kvf {

RpcEndpoint parse_rpc_endpoint(const std::string & s) {
    auto bad = [&](const std::string & why) {
        return std::invalid_argument("bad RPC endpoint '" + s + "': " + why + " (expected host:port, e.g. 127.0.0.1:50052)");
    };
    const size_t colon = s.rfind(':');
    if (colon == std::string::npos) throw bad("no port");
    RpcEndpoint ep;
    ep.host = s.substr(0, colon);
    const std::string port = s.substr(colon + 1);
    if (ep.host.empty()) throw bad("no host");
    if (ep.host.find(':') != std::string::npos || ep.host.front() == '[') throw bad("ggml-rpc takes no IPv6 address");
    for (char c : ep.host) {
        if (!(std::isalnum((unsigned char) c) || c == '.' || c == '-' || c == '_')) throw bad("invalid host name");
    }
    if (port.empty() || port.size() > 5) throw bad("the port must be a number in 1..65535");
    for (char c : port) if (c < '0' || c > '9') throw bad("the port must be a number in 1..65535");
    ep.port = std::stoi(port);
    if (ep.port < 1 || ep.port > 65535) throw bad("the port must be a number in 1..65535");
    return ep;
}

namespace {

struct Fd {
    int fd = -1;
    ~Fd() { if (fd >= 0) ::close(fd); }
};

bool send_all(int fd, const void * p, size_t n) {
    const char * c = static_cast<const char *>(p);
    while (n > 0) {
        const ssize_t k = ::send(fd, c, n, MSG_NOSIGNAL);
        if (k <= 0) { if (k < 0 && errno == EINTR) continue; return false; }
        c += k; n -= (size_t) k;
    }
    return true;
}

bool recv_all(int fd, void * p, size_t n) {
    char * c = static_cast<char *>(p);
    while (n > 0) {
        const ssize_t k = ::recv(fd, c, n, 0);
        if (k <= 0) { if (k < 0 && errno == EINTR) continue; return false; }
        c += k; n -= (size_t) k;
    }
    return true;
}

// ggml-rpc's wire format (ggml-rpc.cpp, protocol 7): a request is | cmd (1 byte) | size (u64) | data |, a
// reply | size (u64) | data |. HELLO is command 14 forever; its request holds the client's transport caps
// (24 bytes, all zero: plain TCP), its reply the version (major, minor, patch, pad) and the server's caps.
constexpr uint8_t k_cmd_hello = 14;
constexpr size_t k_caps = 24;

}  // namespace

void check_rpc_endpoint(const RpcEndpoint & ep, double timeout_s) {
    const std::string name = "RPC server " + ep.text();
    addrinfo hints{};
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo * res = nullptr;
    const int gai = ::getaddrinfo(ep.host.c_str(), std::to_string(ep.port).c_str(), &hints, &res);
    if (gai != 0 || !res) {
        throw RpcUnreachable(name + ": cannot resolve host '" + ep.host + "' (" + gai_strerror(gai) + ")");
    }
    Fd s;
    s.fd = ::socket(res->ai_family, res->ai_socktype, res->ai_protocol);
    if (s.fd < 0) { ::freeaddrinfo(res); throw RpcUnreachable(name + ": socket() failed: " + std::strerror(errno)); }
    const int ms = (int) std::lround(timeout_s * 1000.0);
    const int flags = ::fcntl(s.fd, F_GETFL, 0);
    ::fcntl(s.fd, F_SETFL, flags | O_NONBLOCK);
    int rc = ::connect(s.fd, res->ai_addr, res->ai_addrlen);
    ::freeaddrinfo(res);
    if (rc != 0 && errno != EINPROGRESS) {
        throw RpcUnreachable(name + " is unreachable: " + std::strerror(errno) + " (is ggml-rpc-server running there?)");
    }
    if (rc != 0) {
        pollfd p{s.fd, POLLOUT, 0};
        rc = ::poll(&p, 1, ms);
        if (rc == 0) throw RpcUnreachable(name + " is unreachable: no connection within " + std::to_string(timeout_s) + " s");
        int err = 0;
        socklen_t len = sizeof(err);
        ::getsockopt(s.fd, SOL_SOCKET, SO_ERROR, &err, &len);
        if (rc < 0 || err != 0) {
            throw RpcUnreachable(name + " is unreachable: " + std::strerror(rc < 0 ? errno : err) +
                                 " (is ggml-rpc-server running there?)");
        }
    }
    ::fcntl(s.fd, F_SETFL, flags);
    timeval tv{};
    tv.tv_sec = ms / 1000;
    tv.tv_usec = (ms % 1000) * 1000;
    ::setsockopt(s.fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    ::setsockopt(s.fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));

    uint8_t req[1 + 8 + k_caps] = {};
    req[0] = k_cmd_hello;
    const uint64_t req_size = k_caps;
    std::memcpy(req + 1, &req_size, 8);   // little-endian hosts only, as ggml-rpc itself
    uint64_t rsp_size = 0;
    uint8_t rsp[4 + k_caps] = {};
    if (!send_all(s.fd, req, sizeof(req)) || !recv_all(s.fd, &rsp_size, 8) || rsp_size != sizeof(rsp) ||
        !recv_all(s.fd, rsp, sizeof(rsp))) {
        throw RpcUnreachable(name + " accepted the connection but did not answer ggml-rpc's handshake within " +
                             std::to_string(timeout_s) + " s (not a ggml-rpc-server, or a busy one)");
    }
#ifdef KVFLASH_RPC
    if (rsp[0] != RPC_PROTO_MAJOR_VERSION || rsp[1] > RPC_PROTO_MINOR_VERSION) {
        throw RpcUnreachable(name + " speaks RPC protocol " + std::to_string(rsp[0]) + "." + std::to_string(rsp[1]) + "." +
                             std::to_string(rsp[2]) + ", this build " + std::to_string(RPC_PROTO_MAJOR_VERSION) + "." +
                             std::to_string(RPC_PROTO_MINOR_VERSION) + ": build both from the same llama.cpp tree");
    }
#endif
}

namespace {

std::mutex g_held_mutex;
std::map<std::string, int> g_held;   // endpoint -> live RpcDevice holds in this process

std::shared_ptr<void> hold_endpoint(const std::string & text) {
    std::lock_guard<std::mutex> lock(g_held_mutex);
    ++g_held[text];
    return std::shared_ptr<void>(new int(0), [text](int * p) {
        delete p;
        std::lock_guard<std::mutex> lock(g_held_mutex);
        if (--g_held[text] == 0) g_held.erase(text);
    });
}

bool held(const std::string & text) {
    std::lock_guard<std::mutex> lock(g_held_mutex);
    return g_held.count(text) > 0;
}

}  // namespace

bool rpc_available() {
    load_backends();
    return ggml_backend_reg_by_name("RPC") != nullptr;
}

namespace {

// The functions our patch adds to ggml-rpc, found through its reg as ggml_backend_rpc_add_server is (the
// portable build loads ggml-rpc as a module). nullptr: no RPC backend, or an unpatched one.
template <typename F>
F rpc_function(ggml_backend_reg_t reg, const char * name) {
    return reg ? reinterpret_cast<F>(ggml_backend_reg_get_proc_address(reg, name)) : nullptr;
}

using endpoint_lost_fn = bool (*)(const char *);
using set_timeout_fn = void (*)(double);
using get_timeout_fn = double (*)();

ggml_backend_reg_t rpc_reg() {
    load_backends();
    return ggml_backend_reg_by_name("RPC");
}

bool endpoint_lost(ggml_backend_reg_t reg, const std::string & text) {
    auto lost = rpc_function<endpoint_lost_fn>(reg, "ggml_backend_rpc_endpoint_lost");
    return lost && lost(text.c_str());
}

std::string lost_message(const std::string & text) {
    char timeout[64] = "";
    if (const double t = rpc_timeout(); t > 0) std::snprintf(timeout, sizeof timeout, " (or did not answer within %g s)", t);
    return "the ggml-rpc server at " + text + " went away" + timeout +
           "; the model's weights and K/V there are lost: load the model again and restore the session from its "
           "last snapshot";
}

}  // namespace

void check_rpc_connection(ggml_backend_t backend) {
    ggml_backend_dev_t dev = backend ? ggml_backend_get_device(backend) : nullptr;
    ggml_backend_reg_t reg = dev ? ggml_backend_dev_backend_reg(dev) : nullptr;
    if (!reg || std::strcmp(ggml_backend_reg_name(reg), "RPC") != 0) return;
    const std::string text = ggml_backend_dev_description(dev);   // an RPC device's description is its endpoint
    if (endpoint_lost(reg, text)) throw RpcLost(lost_message(text));
}

void check_rpc_connections(ggml_backend_sched_t sched) {
    for (int i = 0; i < ggml_backend_sched_get_n_backends(sched); ++i) {
        check_rpc_connection(ggml_backend_sched_get_backend(sched, i));
    }
}

void set_rpc_timeout(double seconds) {
    if (!(seconds == 0 || (seconds >= 0.001 && seconds <= 1e6))) {
        throw std::invalid_argument("rpc timeout " + std::to_string(seconds) + " s: expected 0 (none) or 0.001 to 1e6 s");
    }
    auto set = rpc_function<set_timeout_fn>(rpc_reg(), "ggml_backend_rpc_set_timeout");
    if (!set) throw std::runtime_error("this build has no ggml RPC backend with connection timeouts (KVFLASH_RPC=ON builds one)");
    set(seconds);
}

double rpc_timeout() {
    auto get = rpc_function<get_timeout_fn>(rpc_reg(), "ggml_backend_rpc_get_timeout");
    return get ? get() : 0.0;
}

RpcDevice rpc_device_init(const std::string & endpoint, double timeout_s) {
    const RpcEndpoint ep = parse_rpc_endpoint(endpoint);
    ggml_backend_reg_t reg = rpc_reg();
    auto add_server = rpc_function<ggml_backend_reg_t (*)(const char *)>(reg, "ggml_backend_rpc_add_server");
    if (!add_server) {
        throw std::runtime_error("an RPC device was asked for, but this build has no ggml RPC backend (build with KVFLASH_RPC=ON)");
    }
    if (!rpc_function<endpoint_lost_fn>(reg, "ggml_backend_rpc_endpoint_lost")) {
        // unpatched, a lost connection would abort the process: refuse rather than run without the check
        throw std::runtime_error("this build's ggml-rpc lacks cpp/patches/ggml-rpc-connection-loss.patch (rebuild)");
    }
    const std::string text = ep.text();
    if (!held(text)) {
        check_rpc_endpoint(ep, timeout_s);
    } else if (endpoint_lost(reg, text)) {
        // ggml-rpc reconnects only once nothing uses the lost connection: the Models on it must go first
        throw RpcLost("the connection to the ggml-rpc server at " + text + " was lost and is still held by a Model "
                      "of this process: close every Model that uses it, then load again");
    }
    // Not ggml_backend_register()ed: ggml-rpc's devices say they are GPUs, and backend="auto" must not pick one.
    ggml_backend_reg_t server = add_server(text.c_str());
    if (!server || ggml_backend_reg_dev_count(server) == 0) {
        throw RpcUnreachable("RPC server " + text + " exposes no device");
    }
    ggml_backend_t b = ggml_backend_dev_init(ggml_backend_reg_dev_get(server, 0), nullptr);
    if (!b) throw RpcUnreachable("could not initialise the first device of RPC server " + text);
    return RpcDevice{b, hold_endpoint(text)};
}

}  // namespace kvf
