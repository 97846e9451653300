#include "model/log_tap.h"

namespace kvf {

namespace {
thread_local LogTap * t_tap = nullptr;
}

LogTap::LogTap() : outer_(t_tap) { t_tap = this; }
LogTap::~LogTap() { t_tap = outer_; }

void LogTap::note(ggml_log_level level, const char * text) {
    const bool cont = level == GGML_LOG_LEVEL_CONT;
    if (!(level == GGML_LOG_LEVEL_ERROR || (cont && last_was_error_))) {
        last_was_error_ = false;
        return;
    }
    std::string line(text ? text : "");
    while (!line.empty() && (line.back() == '\n' || line.back() == '\r' || line.back() == ' ')) line.pop_back();
    last_was_error_ = true;
    // ggml and libllama start each line with the logging function's name: noise in an exception.
    const size_t colon = line.find(": ");
    if (!cont && colon != std::string::npos &&
        line.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_") == colon) {
        line.erase(0, colon + 2);
    }
    if (line.empty() || line == "failed to load model") return;
    // Bounded: a loader that logs per key must not grow an exception message without limit.
    if (errors_.size() > 2000) return;
    errors_ += (errors_.empty() || cont ? "" : "; ") + line;
}

void log_tap_note(ggml_log_level level, const char * text) {
    if (t_tap) t_tap->note(level, text);
}

std::string with_reason(const std::string & what, const LogTap & tap) {
    return tap.errors().empty() ? what : what + ": " + tap.errors();
}

}  // namespace kvf
