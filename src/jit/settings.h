// The settings of include/attnforge/jit.h as one snapshot: each cache lookup reads them afresh, so a change
// through the API or the environment applies to the next lookup.
#pragma once

#include <string>

#include "attnforge/jit.h"

namespace attnforge::jit {

struct CacheSettings {
  std::string dir;  // empty: no disk cache (memory only)
  CacheMode mode = CacheMode::kOn;
  LogSink log;  // null: stderr
  bool quiet = false;
};

CacheSettings current_settings();

// Where the cache lives when neither the API nor ATTNFORGE_CACHE_DIR says: $XDG_CACHE_HOME/attnforge/kernels,
// else $HOME/.cache/attnforge/kernels; empty when neither variable is set.
std::string default_cache_dir();

void log_line(const CacheSettings& settings, const std::string& line);

}  // namespace attnforge::jit
