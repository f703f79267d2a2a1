// The kernel cache: a per-process memory cache in front of a per-user disk cache.
//
// The key is a hash of everything that determines the cubin: the generated source, the text of every embedded
// header, the entry points, the NVRTC version, the compile options (architecture included) and the attnforge
// version. Never file times, a caller-chosen name or a path.
//
// On disk each entry is one file, <readable name>.<key>.kernel, published atomically (written to a temporary
// file in the same directory, then renamed over the final name; two processes that race each publish a complete
// file and each uses its own result). A file is loaded only after its header (magic, format, key, lengths) and
// the hash of its payload check out; a truncated or damaged entry is recompiled, never loaded. The directory is
// created with mode 0700 and is used only when it and the entry file belong to the user and nobody else can
// write them.
#pragma once

#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>

#include "jit/hash.h"
#include "jit/nvrtc_compiler.h"
#include "jit/settings.h"

namespace attnforge::jit {

// The cache key of a source compiled with `options` (compile_options(source.arch) in use) against `headers`.
Hash128 cache_key(const KernelSource& source, const std::vector<std::string>& options,
                  std::span<const EmbeddedHeader> headers = embedded_headers());

// The bytes of a disk entry, and their parse (nullopt-like: ok false with the reason).
std::string encode_entry(const Hash128& key, const CompiledModule& module);
struct DecodedEntry {
  bool ok = false;
  std::string problem;  // why the entry cannot be used
  CompiledModule module;
};
DecodedEntry decode_entry(const Hash128& key, std::string_view bytes);

// The file name of an entry: "<name>.<key hex>.kernel".
std::string entry_file_name(const std::string& name, const Hash128& key);

enum class Origin { kMemory, kDisk, kCompiled };
const char* to_string(Origin origin);

struct Lookup {
  std::shared_ptr<const CompiledModule> module;
  Hash128 key;
  Origin origin = Origin::kMemory;
  double seconds = 0;  // compile, or read and verify
};

class KernelCache {
 public:
  // Returns the compiled module of `source`: from memory, from disk, or compiled (and published in mode on).
  // Concurrent lookups of one key in this process compile it once. Throws in mode off when the kernel is in
  // neither cache, and when compilation fails.
  Lookup get(const KernelSource& source, const CacheSettings& settings);

 private:
  struct Slot {
    bool ready = false;
    std::shared_ptr<const CompiledModule> module;
  };
  std::mutex mutex_;
  std::condition_variable ready_;
  std::map<std::string, Slot> slots_;  // by key hex; a slot without `ready` is being produced by one thread
};

// The cache run() and warm-up use, with the settings of include/attnforge/jit.h.
KernelCache& process_cache();

}  // namespace attnforge::jit
