// ggml and libllama report why a file failed to load only through their log callback (gguf_init_from_file
// and llama_model_load_from_file return null). A LogTap on the stack collects the error lines this
// thread logs while it lives, so the exception can carry the reason instead of a generic "failed".
// The process's log callback (bindings/bind_log.cpp) hands every line to log_tap_note().
#pragma once

#include "ggml.h"

#include <string>

namespace kvf {

class LogTap {
public:
    LogTap();
    ~LogTap();
    LogTap(const LogTap &) = delete;
    LogTap & operator=(const LogTap &) = delete;

    // The error lines seen so far, joined with "; " (empty when none).
    const std::string & errors() const { return errors_; }
    void note(ggml_log_level level, const char * text);

private:
    LogTap * outer_ = nullptr;   // taps nest: each line goes to the innermost
    std::string errors_;
    bool last_was_error_ = false;   // GGML_LOG_LEVEL_CONT continues the previous line
};

void log_tap_note(ggml_log_level level, const char * text);

// what + ": " + the tapped reason, or what alone when nothing was logged.
std::string with_reason(const std::string & what, const LogTap & tap);

}  // namespace kvf
