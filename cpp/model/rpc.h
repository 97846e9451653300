// ggml-rpc devices (an rpc-server on another host, or this one): the endpoint's spelling, a check that it
// answers, the backend of its first device, and the check that its connection still stands. ggml-rpc itself
// aborts the process (GGML_ABORT) when it cannot connect or the handshake fails, so every endpoint is checked
// here, with a timeout, before ggml sees it. A connection lost later (the server died, dropped it, or went
// silent past the timeout) no longer aborts: our patch of ggml-rpc (cpp/patches/ggml-rpc-connection-loss.patch)
// marks it lost and completes every command at once with zeros, and check_rpc_connection turns that into
// RpcLost where results are used.
#pragma once

#include "ggml-backend.h"

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvf {

// The endpoint could not be reached, did not answer the handshake in time, or speaks another protocol
// version (Python: ConnectionError).
class RpcUnreachable : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

// The connection to an RPC device was lost after it was made (Python: ConnectionError too). The device's
// weights and buffers are gone with it: the model must be loaded again.
class RpcLost : public RpcUnreachable {
public:
    using RpcUnreachable::RpcUnreachable;
};

struct RpcEndpoint {
    std::string host;
    int port = 0;
    std::string text() const { return host + ":" + std::to_string(port); }
};

// "host:port" (a name or IPv4 address; ggml-rpc takes no IPv6 literal). std::invalid_argument otherwise.
RpcEndpoint parse_rpc_endpoint(const std::string & spelling);

// Connects with a timeout and runs ggml-rpc's HELLO handshake (protocol version check), then closes.
// Throws RpcUnreachable naming the endpoint. timeout_s bounds the connect and each read/write.
void check_rpc_endpoint(const RpcEndpoint & ep, double timeout_s = 5.0);

struct RpcDevice {
    ggml_backend_t backend = nullptr;
    // Held while the backend is in use (the Model keeps it): an rpc-server serves one connection at a time and
    // ggml-rpc shares one connection per endpoint in a process, so while this process holds one, a second
    // Model on the same endpoint skips the handshake check (it would wait on the busy server) and shares it.
    std::shared_ptr<void> hold;
};

// The first device of the server at `endpoint` ("host:port", parsed and checked first). std::runtime_error when
// this build has no RPC backend (KVFLASH_RPC=OFF).
RpcDevice rpc_device_init(const std::string & endpoint, double timeout_s = 5.0);

bool rpc_available();   // the RPC backend is compiled in (or loaded as a module)

// Throws RpcLost naming the endpoint when `backend` is a ggml-rpc device whose connection this process lost;
// any other backend passes (a few string compares and a map look-up: cheap enough for every step). Call it
// where results of device work are used: after a loss, every read returns zeros.
void check_rpc_connection(ggml_backend_t backend);
// The same for every backend of a scheduler: the devices a step ran on.
void check_rpc_connections(ggml_backend_sched_t sched);

// The send/receive timeout of RPC connections made from now on, in seconds (0: none; default 120): a server
// that makes no progress for that long counts as lost. Process-wide, as the connections are (one per
// endpoint, shared by the Models of the process). A graph's compute is waited for in the reply read after
// it, so the timeout must also exceed the longest step. std::invalid_argument outside {0} and [0.001, 1e6].
void set_rpc_timeout(double seconds);
double rpc_timeout();

}  // namespace kvf
