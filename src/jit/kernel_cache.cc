#include "jit/kernel_cache.h"

#include <errno.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>

#include "core/check.h"
#include "jit/host_compiler.h"

namespace attnforge::jit {

namespace {

constexpr char kMagic[8] = {'A', 'F', 'K', 'E', 'R', 'N', 'E', 'L'};
constexpr uint32_t kFormat = 1;

// The fixed-size start of an entry file; the payload follows: the readable name, the lowered names (each
// NUL-terminated) and the binary (a cubin or a shared object). Native byte order: an entry is read on the machine that wrote it.
struct EntryHeader {
  char magic[8];
  uint32_t format;
  uint32_t num_entry_points;
  uint64_t key_high, key_low;
  uint64_t name_bytes, lowered_bytes, binary_bytes;
  uint64_t payload_high, payload_low;  // XXH3-128 of the payload
};
static_assert(sizeof(EntryHeader) == 72, "the entry header has no padding");

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string errno_text() { return std::strerror(errno); }

// Why `st` (of a directory or an entry) must not be trusted, or "" when only this user can write it.
std::string ownership_problem(const struct stat& st) {
  if (st.st_uid != geteuid()) return fmt::format("owned by uid {}, not by this user (uid {})", st.st_uid, geteuid());
  if (st.st_mode & (S_IWGRP | S_IWOTH))
    return fmt::format("mode {:04o} lets {} write it", st.st_mode & 07777,
                       st.st_mode & S_IWOTH ? "every user" : "its group");
  return "";
}

// Makes sure `dir` exists (creating it and missing parents with mode 0700 when `create`) and that only this user
// can write it. Returns "" when the cache may use it, else why not.
std::string prepare_dir(const std::string& dir, bool create) {
  if (create) {
    for (size_t pos = 1; pos != std::string::npos;) {
      pos = dir.find('/', pos + 1);
      const std::string part = dir.substr(0, pos);
      if (mkdir(part.c_str(), 0700) != 0 && errno != EEXIST)
        return fmt::format("cannot create {}: {}", part, errno_text());
    }
  }
  struct stat st;
  if (stat(dir.c_str(), &st) != 0) return fmt::format("{}", errno_text());
  if (!S_ISDIR(st.st_mode)) return "not a directory";
  return ownership_problem(st);
}

enum class ReadStatus { kFound, kMissing, kRefused };
struct ReadResult {
  ReadStatus status;
  std::string bytes;
  std::string problem;
};

// Reads an entry without following a symbolic link, checking the opened file itself (not the path, which could
// change between a check and the open).
ReadResult read_entry(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return {ReadStatus::kMissing, "", ""};
    return {ReadStatus::kRefused, "", fmt::format("cannot open it: {}", errno_text())};
  }
  ReadResult r{ReadStatus::kFound, "", ""};
  struct stat st;
  if (fstat(fd, &st) != 0) {
    r = {ReadStatus::kRefused, "", errno_text()};
  } else if (!S_ISREG(st.st_mode)) {
    r = {ReadStatus::kRefused, "", "not a regular file"};
  } else if (std::string why = ownership_problem(st); !why.empty()) {
    r = {ReadStatus::kRefused, "", why};
  } else {
    r.bytes.resize(static_cast<size_t>(st.st_size));
    size_t done = 0;
    while (done < r.bytes.size()) {
      const ssize_t n = read(fd, r.bytes.data() + done, r.bytes.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      done += static_cast<size_t>(n);
    }
    r.bytes.resize(done);  // a file shorter than its size said fails the length check
  }
  close(fd);
  return r;
}

// Writes `bytes` to a temporary file in `dir` and renames it to `path`. Returns "" or the reason it failed.
std::string publish(const std::string& dir, const std::string& path, const std::string& bytes) {
  static std::atomic<uint64_t> counter{0};
  const std::string tmp = fmt::format("{}/.tmp.{}.{}.kernel", dir, getpid(), counter++);
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return fmt::format("cannot create {}: {}", tmp, errno_text());
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  std::string problem;
  if (done != bytes.size()) problem = fmt::format("writing {}: {}", tmp, errno_text());
  // Data before name: after a crash the final name holds either nothing or a complete entry.
  if (problem.empty() && fsync(fd) != 0) problem = fmt::format("fsync {}: {}", tmp, errno_text());
  close(fd);
  if (problem.empty() && rename(tmp.c_str(), path.c_str()) != 0)
    problem = fmt::format("rename to {}: {}", path, errno_text());
  if (!problem.empty()) unlink(tmp.c_str());
  return problem;
}

}  // namespace

Hash128 cache_key(const KernelSource& source, const std::vector<std::string>& options,
                  std::span<const EmbeddedHeader> headers) {
  Hasher h;
  const NvrtcVersion v = nvrtc_version();
  h.field("attnforge kernel cache key 1").field(ATTNFORGE_VERSION);
  h.field(source.arch == kHostArch ? host_compiler_identity() : fmt::format("nvrtc {}.{}", v.major, v.minor));
  h.field(source.arch);
  h.field(std::to_string(options.size()));
  for (const std::string& o : options) h.field(o);
  h.field(std::to_string(source.entry_points.size()));
  for (const std::string& e : source.entry_points) h.field(e);
  h.field(source.source);
  h.field(std::to_string(headers.size()));
  for (const EmbeddedHeader& e : headers) h.field(e.name).field(e.text);
  return h.digest();
}

std::string encode_entry(const Hash128& key, const CompiledModule& module) {
  std::string payload = module.name;
  std::string lowered;
  for (const std::string& n : module.lowered_names) lowered.append(n).push_back('\0');
  payload += lowered;
  payload += module.binary;
  EntryHeader h{};
  std::memcpy(h.magic, kMagic, sizeof(kMagic));
  h.format = kFormat;
  h.num_entry_points = static_cast<uint32_t>(module.lowered_names.size());
  h.key_high = key.high, h.key_low = key.low;
  h.name_bytes = module.name.size(), h.lowered_bytes = lowered.size(), h.binary_bytes = module.binary.size();
  const Hash128 ph = hash_bytes(payload.data(), payload.size());
  h.payload_high = ph.high, h.payload_low = ph.low;
  std::string out(reinterpret_cast<const char*>(&h), sizeof(h));
  return out + payload;
}

DecodedEntry decode_entry(const Hash128& key, std::string_view bytes) {
  DecodedEntry d;
  auto bad = [&](std::string why) {
    d.problem = std::move(why);
    return d;
  };
  EntryHeader h;
  if (bytes.size() < sizeof(h)) return bad(fmt::format("{} bytes, shorter than the {}-byte header", bytes.size(), sizeof(h)));
  std::memcpy(&h, bytes.data(), sizeof(h));
  if (std::memcmp(h.magic, kMagic, sizeof(kMagic)) != 0) return bad("not an attnforge kernel cache entry (magic)");
  if (h.format != kFormat) return bad(fmt::format("entry format {}, expected {}", h.format, kFormat));
  if (h.key_high != key.high || h.key_low != key.low) return bad("the entry's key is not its file name's key");
  const uint64_t payload = bytes.size() - sizeof(h);
  if (h.name_bytes > payload || h.lowered_bytes > payload || h.binary_bytes > payload ||
      h.name_bytes + h.lowered_bytes + h.binary_bytes != payload)
    return bad(fmt::format("lengths {} + {} + {} do not add up to the {} payload bytes (truncated?)", h.name_bytes,
                           h.lowered_bytes, h.binary_bytes, payload));
  const std::string_view body = bytes.substr(sizeof(h));
  if (hash_bytes(body.data(), body.size()) != Hash128{h.payload_high, h.payload_low})
    return bad("the payload does not match its hash (damaged)");
  if (h.binary_bytes == 0) return bad("empty binary");
  d.module.name = std::string(body.substr(0, h.name_bytes));
  std::string_view lowered = body.substr(h.name_bytes, h.lowered_bytes);
  while (!lowered.empty()) {
    const size_t end = lowered.find('\0');
    if (end == std::string_view::npos) return bad("unterminated kernel name");
    d.module.lowered_names.emplace_back(lowered.substr(0, end));
    lowered.remove_prefix(end + 1);
  }
  if (d.module.lowered_names.size() != h.num_entry_points) return bad("wrong number of kernel names");
  d.module.binary = std::string(body.substr(h.name_bytes + h.lowered_bytes));
  d.ok = true;
  return d;
}

std::string entry_file_name(const std::string& name, const Hash128& key) {
  return fmt::format("{}.{}.kernel", name, key.hex());
}

const char* to_string(Origin origin) {
  switch (origin) {
    case Origin::kMemory: return "memory";
    case Origin::kDisk: return "disk";
    case Origin::kCompiled: return "compiled";
  }
  return "?";
}

Lookup KernelCache::get(const KernelSource& source, const CacheSettings& settings) {
  Lookup out;
  const bool host = source.arch == kHostArch;
  out.key = cache_key(source, host ? host_compile_options() : compile_options(source.arch, source.default_device));
  const std::string hex = out.key.hex();
  {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      auto it = slots_.find(hex);
      if (it == slots_.end()) {
        slots_[hex];  // this thread produces it; others wait
        break;
      }
      if (it->second.ready) {
        out.module = it->second.module;
        return out;
      }
      ready_.wait(lock);
    }
  }
  auto finish = [&](std::shared_ptr<const CompiledModule> module) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (module) {
      slots_[hex] = {true, module};
    } else {
      slots_.erase(hex);  // failed: the next lookup tries again
    }
    ready_.notify_all();
  };
  try {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string file = entry_file_name(source.name, out.key);
    std::string path, dir_problem;
    if (settings.dir.empty()) {
      dir_problem = "no cache directory (set ATTNFORGE_CACHE_DIR or HOME)";
    } else {
      dir_problem = prepare_dir(settings.dir, settings.mode == CacheMode::kOn);
      if (!dir_problem.empty() && settings.mode == CacheMode::kOn)
        log_line(settings, fmt::format("attnforge jit: not using the kernel cache {}: {}; kernels stay in memory",
                                       settings.dir, dir_problem));
      if (dir_problem.empty()) path = settings.dir + "/" + file;
    }
    if (!path.empty()) {
      const ReadResult r = read_entry(path);
      if (r.status == ReadStatus::kFound) {
        DecodedEntry d = decode_entry(out.key, r.bytes);
        if (d.ok) {
          auto module = std::make_shared<const CompiledModule>(std::move(d.module));
          out.module = module;
          out.origin = Origin::kDisk;
          out.seconds = seconds_since(t0);
          finish(module);
          return out;
        }
        log_line(settings, fmt::format("attnforge jit: cache entry {} is unusable ({}); recompiling it", path, d.problem));
      } else if (r.status == ReadStatus::kRefused) {
        log_line(settings, fmt::format("attnforge jit: refusing cache entry {}: {}", path, r.problem));
      }
    }
    if (settings.mode == CacheMode::kOff)
      detail::fail(ErrorKind::kUnsupported,
                   "kernel {} (cache key {}) is not in the kernel cache {}{} and run-time compilation is off "
                   "(ATTNFORGE_CACHE_MODE=off); warm the cache first with `{}` (or attnforge::jit::warmup), or set "
                   "ATTNFORGE_CACHE_MODE=on",
                   source.name, hex, settings.dir.empty() ? "(none)" : settings.dir,
                   dir_problem.empty() ? "" : " (" + dir_problem + ")", source.warmup_command);

    log_line(settings, fmt::format("attnforge jit: compiling {} for {} (cache key {}) ...", source.name, source.arch, hex));
    const auto t1 = std::chrono::steady_clock::now();
    auto module = std::make_shared<const CompiledModule>(host ? compile_host(source) : compile(source));
    out.seconds = seconds_since(t1);
    std::string where = "kept in memory";
    if (settings.mode == CacheMode::kOn && !path.empty()) {
      const std::string problem = publish(settings.dir, path, encode_entry(out.key, *module));
      where = problem.empty() ? "cached in " + settings.dir : "not cached: " + problem;
    } else if (settings.mode == CacheMode::kReadOnly) {
      where = "kept in memory (cache mode read-only)";
    }
    log_line(settings, fmt::format("attnforge jit: compiled {} in {:.2f} s ({} KB {}); {}", source.name, out.seconds,
                                   module->binary.size() / 1024, host ? "shared object" : "cubin", where));
    if (!module->log.empty())
      log_line(settings, fmt::format("attnforge jit: {} on {}: {}", host ? "the host compiler" : "NVRTC", source.name,
                                     module->log));
    out.module = module;
    out.origin = Origin::kCompiled;
    finish(module);
    return out;
  } catch (...) {
    finish(nullptr);
    throw;
  }
}

KernelCache& process_cache() {
  static KernelCache cache;
  return cache;
}

}  // namespace attnforge::jit
