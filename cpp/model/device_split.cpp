#include "model/device_split.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <stdexcept>

namespace kvf {

namespace {

std::string lower(std::string s) {
    for (char & c : s) c = (char) std::tolower((unsigned char) c);
    return s;
}

bool all_digits(const std::string & s) {
    return !s.empty() && std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isdigit(c); });
}

}  // namespace

DeviceSpec parse_device(const std::string & spelling) {
    const std::string s = lower(spelling);
    DeviceSpec d;
    if (s == "cpu") return d;
    if (s.rfind("cuda", 0) == 0 && (s.size() == 4 || (all_digits(s.substr(4)) && s.size() <= 7))) {
        d.kind = DeviceSpec::Kind::gpu;
        d.index = s.size() == 4 ? 0 : std::stoi(s.substr(4));
        return d;
    }
    if (s.rfind("rpc:", 0) == 0 && s.size() > 4) {
        d.kind = DeviceSpec::Kind::rpc;
        d.endpoint = spelling.substr(4);   // parsed (and checked) where it is opened
        return d;
    }
    throw std::invalid_argument("unknown device '" + spelling + "' (expected cpu, cuda, cudaN or rpc:HOST:PORT)");
}

std::vector<int> split_layers(int64_t n_layer, const std::vector<double> & shares) {
    if (shares.empty()) throw std::invalid_argument("tensor_split: no devices");
    double total = 0.0;
    for (double s : shares) {
        if (!std::isfinite(s) || s < 0.0) {
            throw std::invalid_argument("tensor_split: every share must be finite and >= 0 (got " + std::to_string(s) + ")");
        }
        total += s;
    }
    if (!(total > 0.0)) throw std::invalid_argument("tensor_split: the shares add up to 0");
    std::vector<double> upto(shares.size());   // cumulative fractions
    double run = 0.0;
    for (size_t d = 0; d < shares.size(); ++d) upto[d] = (run += shares[d]) / total;
    upto.back() = 1.0;   // rounding must not leave the last slot without a device
    std::vector<int> device(n_layer + 1);
    for (int64_t il = 0; il <= n_layer; ++il) {
        const double at = (double) il / (double) (n_layer + 1);
        device[il] = (int) (std::upper_bound(upto.begin(), upto.end(), at) - upto.begin());
    }
    return device;
}

}  // namespace kvf
