// The NCCL calls context parallelism makes, from libnccl opened with dlopen on first use (not linked: a build
// and its tests run on machines without NCCL, and the GPU machines carry it inside their PyTorch). NCCL's types
// are declared here by their documented ABI (ncclComm_t an opaque pointer, ncclResult_t and ncclDataType_t
// ints), so no NCCL header is needed to build. The library is libnccl.so.2, or ATTNFORGE_NCCL_LIBRARY's path.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace attnforge::cuda {

using NcclComm = void*;  // ncclComm_t
struct NcclUniqueId {    // ncclUniqueId: 128 opaque bytes
  char internal[128];
};
constexpr int kNcclInt8 = 0;  // ncclInt8 (= ncclChar)

struct NcclApi {
  int (*ncclGetUniqueId)(NcclUniqueId*);
  int (*ncclCommInitRank)(NcclComm*, int, NcclUniqueId, int);
  int (*ncclCommDestroy)(NcclComm);
  int (*ncclAllGather)(const void*, void*, size_t, int, NcclComm, cudaStream_t);
  int (*ncclCommCount)(const NcclComm, int*);
  int (*ncclCommUserRank)(const NcclComm, int*);
  int (*ncclCommCuDevice)(const NcclComm, int*);
  const char* (*ncclGetErrorString)(int);
};

// Throws Error(kBackend) naming the library when it or one of the functions is missing.
const NcclApi& nccl();

// Throws Error(kBackend) naming the call and NCCL's error string.
void check_nccl(int result, const char* call);

}  // namespace attnforge::cuda

#define ATTNFORGE_NCCL_CHECK(expr) ::attnforge::cuda::check_nccl((expr), #expr)
