#include "jit/hash.h"

#include <fmt/format.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace attnforge::jit {

std::string Hash128::hex() const { return fmt::format("{:016x}{:016x}", high, low); }

Hash128 hash_bytes(const void* data, size_t size) {
  const XXH128_hash_t h = XXH3_128bits(data, size);
  return {h.high64, h.low64};
}

Hasher::Hasher() : state_(XXH3_createState()) { XXH3_128bits_reset(static_cast<XXH3_state_t*>(state_)); }
Hasher::~Hasher() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }

Hasher& Hasher::field(std::string_view bytes) {
  const uint64_t size = bytes.size();
  XXH3_128bits_update(static_cast<XXH3_state_t*>(state_), &size, sizeof(size));
  XXH3_128bits_update(static_cast<XXH3_state_t*>(state_), bytes.data(), bytes.size());
  return *this;
}

Hash128 Hasher::digest() const {
  const XXH128_hash_t h = XXH3_128bits_digest(static_cast<XXH3_state_t*>(state_));
  return {h.high64, h.low64};
}

}  // namespace attnforge::jit
