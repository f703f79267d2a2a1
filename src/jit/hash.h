// Content hashes of the kernel cache: XXH3-128 (xxHash, used header-only). The cache directory belongs to one
// user and nobody else can write it, so the hash guards against accidental collisions and damaged files, not
// against an adversary; 128 bits make an accidental collision negligible.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace attnforge::jit {

struct Hash128 {
  uint64_t high = 0, low = 0;
  std::string hex() const;  // 32 lowercase hex digits
  bool operator==(const Hash128&) const = default;
};

Hash128 hash_bytes(const void* data, size_t size);

// Incremental hash of a sequence of fields. Each field is length-prefixed, so ("ab", "c") and ("a", "bc")
// hash differently.
class Hasher {
 public:
  Hasher();
  ~Hasher();
  Hasher(const Hasher&) = delete;
  Hasher& operator=(const Hasher&) = delete;
  Hasher& field(std::string_view bytes);
  Hash128 digest() const;

 private:
  void* state_;
};

}  // namespace attnforge::jit
