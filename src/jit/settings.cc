#include "jit/settings.h"

#include <fmt/format.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>

#include "core/check.h"
#include "core/env.h"

namespace attnforge::jit {

namespace {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

// API overrides; unset fields fall back to the environment, read at each lookup.
struct Overrides {
  std::mutex mutex;
  std::optional<std::string> dir;
  std::optional<CacheMode> mode;
  LogSink log;
  std::optional<bool> quiet;
};
Overrides& overrides() {
  static Overrides o;
  return o;
}

}  // namespace

CacheMode parse_cache_mode(const std::string& text) {
  if (text == "on") return CacheMode::kOn;
  if (text == "read-only") return CacheMode::kReadOnly;
  if (text == "off") return CacheMode::kOff;
  detail::fail_arg("cache mode '{}': expected one of {{on, read-only, off}}", text);
}

std::string default_cache_dir() {
  const std::string xdg = env("XDG_CACHE_HOME");
  if (!xdg.empty()) return xdg + "/attnforge/kernels";
  const std::string home = env("HOME");
  if (!home.empty()) return home + "/.cache/attnforge/kernels";
  return "";
}

CacheSettings current_settings() {
  Overrides& o = overrides();
  std::lock_guard<std::mutex> lock(o.mutex);
  CacheSettings s;
  s.dir = o.dir ? *o.dir : !env("ATTNFORGE_CACHE_DIR").empty() ? env("ATTNFORGE_CACHE_DIR") : default_cache_dir();
  const std::string mode = env("ATTNFORGE_CACHE_MODE");
  s.mode = o.mode ? *o.mode : mode.empty() ? CacheMode::kOn : parse_cache_mode(mode);
  s.log = o.log;
  s.quiet = o.quiet ? *o.quiet : env("ATTNFORGE_JIT_LOG") == "quiet";
  return s;
}

void log_line(const CacheSettings& settings, const std::string& line) {
  if (settings.quiet) return;
  if (settings.log) {
    settings.log(line);
  } else {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
}

void set_cache_dir(const std::string& dir) {
  std::lock_guard<std::mutex> lock(overrides().mutex);
  overrides().dir = dir.empty() ? std::nullopt : std::optional<std::string>(dir);
}
std::string cache_dir() { return current_settings().dir; }

void set_cache_mode(CacheMode mode) {
  std::lock_guard<std::mutex> lock(overrides().mutex);
  overrides().mode = mode;
}
CacheMode cache_mode() { return current_settings().mode; }

void set_log_sink(LogSink sink) {
  std::lock_guard<std::mutex> lock(overrides().mutex);
  overrides().log = std::move(sink);
}
void set_quiet(bool quiet) {
  std::lock_guard<std::mutex> lock(overrides().mutex);
  overrides().quiet = quiet;
}

// Read on every launch, so an atomic rather than the settings' mutex; the environment is read once.
namespace {
std::atomic<int> kernels_override{-1};
CudaKernels kernels_from_env() {
  return detail::env_choice("ATTNFORGE_KERNELS", {"nvcc", "nvrtc"}, "nvcc") == "nvrtc" ? CudaKernels::kNvrtc
                                                                                      : CudaKernels::kNvcc;
}
}  // namespace

void set_cuda_kernels(CudaKernels kernels) { kernels_override.store(static_cast<int>(kernels)); }
CudaKernels cuda_kernels() {
  const int o = kernels_override.load(std::memory_order_relaxed);
  if (o >= 0) return static_cast<CudaKernels>(o);
  static const CudaKernels from_env = kernels_from_env();
  return from_env;
}

}  // namespace attnforge::jit
