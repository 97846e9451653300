// The devices a model's layers are split across (llama.cpp's layer split, `--split-mode layer`): how a device
// is spelled, and which device holds each layer. Each layer's weights, and its K/V (pool rows, ring or
// recurrent state), live on its device; ggml's scheduler runs each layer where its weights are and copies only
// the hidden state between devices. Opening the devices is the Model's (model.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvf {

// One entry of `devices`: "cpu" (this host's CPU), "cuda" / "cudaN" (this host's GPU N; ggml's own names such as
// "CUDA0" too), or "rpc:HOST:PORT" (the first device of a ggml-rpc-server). std::invalid_argument otherwise.
struct DeviceSpec {
    enum class Kind { cpu, gpu, rpc };
    Kind kind = Kind::cpu;
    int index = 0;          // gpu: which one
    std::string endpoint;   // rpc: "host:port"
};
DeviceSpec parse_device(const std::string & spelling);

// Layer il in [0, n_layer] -> index of its device; slot n_layer is the output layer (final norm, logits, the MTP
// head). `shares` are the devices' proportions (llama.cpp's --tensor-split; any positive scale): layer i goes to
// the first device whose cumulative share exceeds i / (n_layer + 1), llama.cpp's rule, so the output layer counts
// as one more layer of the last device that takes any. std::invalid_argument for a negative, non-finite or
// all-zero split.
std::vector<int> split_layers(int64_t n_layer, const std::vector<double> & shares);

}  // namespace kvf
