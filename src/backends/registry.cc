// The selector: device -> backend, configuration -> verdict.
#include <fmt/format.h>

#include "backends/backend.h"
#include "core/check.h"
#include "core/shape.h"

namespace attnforge::detail {

Backend& cpu_backend();
#if ATTNFORGE_WITH_CUDA
Backend* cuda_backend(int32_t device);  // null when the device does not exist at run time
#endif

namespace {
const char* kDevicesBuilt =
#if ATTNFORGE_WITH_CUDA
    "{cpu, cuda}";
#else
    "{cpu} (this build has no CUDA backend: nvcc was not found when it was configured)";
#endif
}  // namespace

void Backend::attention_variant(const AttentionParams&, PlanKind, const std::string& name, const std::string&,
                                const VariantArgs&, Stream) {
  fail(ErrorKind::kUnsupported, "variant {} on the {} backend: not supported there", name, this->name());
}

Backend& backend_for(Device device) {
  switch (device.type) {
    case DeviceType::kCPU: return cpu_backend();
    case DeviceType::kCUDA:
#if ATTNFORGE_WITH_CUDA
      if (Backend* b = cuda_backend(device.id)) return *b;
      fail(ErrorKind::kUnsupported, "device {}: no such CUDA device at run time", to_string(device));
#else
      break;
#endif
  }
  fail(ErrorKind::kUnsupported, "device {}: not served by this build; devices served: {}", to_string(device),
       kDevicesBuilt);
}

Selection select(const AttentionConfig& config) {
  Selection s;
  s.support = check_common(config);
  if (!s.support) {
    s.invalid = true;
    return s;
  }
  try {
    s.backend = &backend_for(config.device);
  } catch (const Error& e) {
    s.support = {false, e.what()};
    return s;
  }
  s.support = s.backend->check(config);
  if (!s.support) s.backend = nullptr;
  return s;
}

Backend& require(const AttentionConfig& config) {
  Selection s = select(config);
  if (!s.support) throw Error(s.invalid ? ErrorKind::kInvalidArgument : ErrorKind::kUnsupported, s.support.reason);
  return *s.backend;
}

}  // namespace attnforge::detail

namespace attnforge {

Support supports(const AttentionConfig& config) { return detail::select(config).support; }

const char* version() { return ATTNFORGE_VERSION; }

}  // namespace attnforge
