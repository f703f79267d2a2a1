// Specialization keys and the selector's verdict. supports() answers from the same function that picks the
// kernel in run(), so "supported" and "runs" never disagree.
#pragma once

#include <string>

#include "attnforge/plan.h"

namespace attnforge {

// Everything that picks a kernel. Lengths, batch size and page counts are run-time values, never keys.
struct AttentionConfig {
  Device device = Device::cpu();
  PlanKind kind = PlanKind::kDecode;
  KVFormat kv_format = KVFormat::kPagedCSR;
  KVLayout kv_layout = KVLayout::kNHD;
  AttentionShape shape;
  int32_t page_size = 16;
  bool custom_mask = false;
  bool rope = false;
};

struct Support {
  bool ok = true;
  std::string reason;  // empty when ok
  explicit operator bool() const { return ok; }
};

Support supports(const AttentionConfig& config);

// Version of the library, "MAJOR.MINOR.PATCH".
const char* version();

}  // namespace attnforge
