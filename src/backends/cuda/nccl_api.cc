#include "backends/cuda/nccl_api.h"

#include <dlfcn.h>

#include <cstdlib>
#include <string>

#include "core/check.h"

namespace attnforge::cuda {

namespace {

template <typename Fn>
void resolve(void* lib, const std::string& path, const char* name, Fn* fn) {
  *fn = reinterpret_cast<Fn>(dlsym(lib, name));
  if (!*fn) detail::fail(ErrorKind::kBackend, "NCCL ({}) has no function {}", path, name);
}

NcclApi load() {
  const char* env = std::getenv("ATTNFORGE_NCCL_LIBRARY");
  const std::string path = env && *env ? env : "libnccl.so.2";
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib)
    detail::fail(ErrorKind::kBackend, "cannot load NCCL {} ({}); context parallelism needs it: set "
                 "ATTNFORGE_NCCL_LIBRARY to libnccl.so.2's path (PyTorch wheels carry one under nvidia/nccl/lib)",
                 path, dlerror());
  NcclApi n{};
  resolve(lib, path, "ncclGetUniqueId", &n.ncclGetUniqueId);
  resolve(lib, path, "ncclCommInitRank", &n.ncclCommInitRank);
  resolve(lib, path, "ncclCommDestroy", &n.ncclCommDestroy);
  resolve(lib, path, "ncclAllGather", &n.ncclAllGather);
  resolve(lib, path, "ncclCommCount", &n.ncclCommCount);
  resolve(lib, path, "ncclCommUserRank", &n.ncclCommUserRank);
  resolve(lib, path, "ncclCommCuDevice", &n.ncclCommCuDevice);
  resolve(lib, path, "ncclGetErrorString", &n.ncclGetErrorString);
  return n;  // stays loaded for the life of the process
}

}  // namespace

const NcclApi& nccl() {
  static const NcclApi api = load();
  return api;
}

void check_nccl(int result, const char* call) {
  if (result != 0) detail::fail(ErrorKind::kBackend, "{}: NCCL error {} ({})", call, result, nccl().ncclGetErrorString(result));
}

}  // namespace attnforge::cuda
