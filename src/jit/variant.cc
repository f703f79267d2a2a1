// run_variant: a custom variant compiled by the host compiler into a shared object (cached by the kernel cache),
// loaded from memory with dlopen, and run over run()'s params.
#include "attnforge/variant.h"

#include <dlfcn.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <mutex>

#include "backends/cpu/convert.h"
#include "backends/cpu/variant_loop.h"
#include "core/check.h"
#include "jit/host_compiler.h"
#include "jit/kernel_cache.h"
#include "ops/prepare.h"

namespace attnforge {

namespace {

using detail::fail;

struct VariantLibrary {
  void (*attention)(const AttentionParams*, const VariantArgs*, const cpu::HostServices*) = nullptr;
  bool softmax = true;
};

jit::KernelSource variant_source(const CustomVariant& v) {
  jit::KernelSource s;
  s.name = "variant_" + v.name + "_host";
  s.arch = jit::kHostArch;
  s.source = fmt::format("// attnforge custom variant {}, CPU loop\n#include \"backends/cpu/variant_loop.h\"\n\n{}\n\n"
                         "ATTNFORGE_VARIANT_ENTRY({})\n",
                         v.name, v.source, v.name);
  s.entry_points = {"attnforge_variant_attention", "attnforge_variant_softmax"};
  s.warmup_command = "a run_variant() call with ATTNFORGE_CACHE_MODE=on (custom variants are not in attnforge warmup)";
  return s;
}

// The shared object of a compiled variant, loaded once per process from a memory file (no path on disk that
// another process could swap between the check and the load).
const VariantLibrary& load(const CustomVariant& v) {
  static std::mutex mutex;
  static std::map<std::string, VariantLibrary> loaded;  // by cache key
  const jit::Lookup l = jit::process_cache().get(variant_source(v), jit::current_settings());
  std::lock_guard<std::mutex> lock(mutex);
  const std::string key = l.key.hex();
  if (auto it = loaded.find(key); it != loaded.end()) return it->second;
  const int fd = memfd_create(v.name.c_str(), MFD_CLOEXEC);
  if (fd < 0) fail(ErrorKind::kBackend, "variant {}: memfd_create failed", v.name);
  const std::string& so = l.module->binary;
  size_t done = 0;
  while (done < so.size()) {
    const ssize_t n = write(fd, so.data() + done, so.size() - done);
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  // The descriptor stays open for the life of the process: dlopen returns the library it already holds under a
  // path, and a closed descriptor's number (hence "/proc/self/fd/N") would come back for the next variant.
  void* handle = done == so.size() ? dlopen(fmt::format("/proc/self/fd/{}", fd).c_str(), RTLD_NOW | RTLD_LOCAL) : nullptr;
  if (!handle) {
    close(fd);
    fail(ErrorKind::kBackend, "variant {}: cannot load its compiled code: {}", v.name, dlerror());
  }
  VariantLibrary lib;
  lib.attention = reinterpret_cast<decltype(lib.attention)>(dlsym(handle, "attnforge_variant_attention"));
  auto softmax = reinterpret_cast<int (*)()>(dlsym(handle, "attnforge_variant_softmax"));
  if (!lib.attention || !softmax) fail(ErrorKind::kBackend, "variant {}: its compiled code lacks the entry points", v.name);
  lib.softmax = softmax() != 0;
  return loaded.emplace(key, lib).first->second;  // stays loaded for the life of the process
}

}  // namespace

CustomVariant builtin_variant() { return {"BuiltinVariant", "using BuiltinVariant = attnforge::BuiltinVariant;"}; }

void run_variant(const AttentionPlan& plan, const TensorView& q, const PagedKVCache& kv, const Outputs& outputs,
                 const AttentionOptions& options, const CustomVariant& variant, const VariantInputs& inputs,
                 const Workspace& workspace, Stream stream) {
  const bool identifier = !variant.name.empty() && !std::isdigit(static_cast<unsigned char>(variant.name[0])) &&
                          std::all_of(variant.name.begin(), variant.name.end(),
                                      [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; });
  if (!identifier) detail::fail_arg("variant.name '{}': expected a C++ identifier (the variant struct's name)", variant.name);
  if (inputs.scalars.size() > kMaxVariantScalars || inputs.tensors.size() > kMaxVariantTensors)
    detail::fail_arg("inputs: {} scalars and {} tensors; at most {} and {}", inputs.scalars.size(),
                     inputs.tensors.size(), kMaxVariantScalars, kMaxVariantTensors);
  if (plan.device.type != DeviceType::kCPU && plan.device.type != DeviceType::kCUDA)
    fail(ErrorKind::kUnsupported, "variant {} on {}: custom variants run on {{cpu, cuda}}", variant.name,
         to_string(plan.device));
  if (!plan.merges.empty())
    fail(ErrorKind::kUnsupported, "variant {}: the plan splits KV ({} merges); custom variants need a plan made with "
         "PlanOptions::disable_split = true", variant.name, plan.merges.size());
  detail::PreparedRun prepared;
  detail::prepare_run(prepared, plan, q, detail::paged_run_params(plan, kv), kv.k, kv.v, kv.layout, outputs, options,
                      workspace);
  VariantArgs args{};
  args.options = &prepared.params.variant;  // the CUDA kernel points it at its own copy
  args.num_scalars = static_cast<int32_t>(inputs.scalars.size());
  for (size_t i = 0; i < inputs.scalars.size(); ++i) args.scalars[i] = inputs.scalars[i];
  args.num_tensors = static_cast<int32_t>(inputs.tensors.size());
  for (size_t i = 0; i < inputs.tensors.size(); ++i) args.tensors[i] = inputs.tensors[i];
  if (plan.device.type == DeviceType::kCUDA) {
    if (plan.shape.kv_dtype != plan.shape.q_dtype)
      fail(ErrorKind::kUnsupported, "variant {} with kv_dtype {}: on CUDA custom variants take K/V in q_dtype {{{}}}",
           variant.name, to_string(plan.shape.kv_dtype), to_string(plan.shape.q_dtype));
    prepared.backend->attention_variant(prepared.params, plan.kind, variant.name, variant.source, args, stream);
    return;
  }
  const VariantLibrary& lib = load(variant);
  const cpu::HostServices services{&cpu::load_row, &cpu::store_row};
  lib.attention(&prepared.params, &args, &services);
}

}  // namespace attnforge
