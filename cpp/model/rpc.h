// ggml-rpc devices (an rpc-server on another host, or this one): the endpoint's spelling, a check that it
// answers, and the backend of its first device. ggml-rpc itself aborts the process (GGML_ABORT) when it
// cannot connect or the handshake fails, so every endpoint is checked here, with a timeout, before ggml
// sees it. A server that dies later, mid-stream, still aborts the process: nothing here can catch that.
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

}  // namespace kvf
