// Error strings and ABI version of the MoK library.
#include <cuda_runtime.h>

#include "mok/common.h"

// Bumped whenever an exported signature changes; the Python side checks it at load time.
static constexpr int kAbiVersion = 6;

MOK_API int mok_abi_version(void) { return kAbiVersion; }

MOK_API const char* mok_error_string(int code) {
  switch (code) {
    case MOK_OK:
      return "no error";
    case MOK_ERR_INVALID_ARGUMENT:
      return "invalid argument (a size or pointer is outside what the kernel supports)";
    case MOK_ERR_UNSUPPORTED:
      return "unsupported configuration for this build";
    default:
      if (code > 0) return cudaGetErrorString(static_cast<cudaError_t>(code));
      return "unknown MoK error code";
  }
}

namespace {

__global__ void mirror_status_kernel(const int32_t* __restrict__ status, int32_t* __restrict__ host) {
  if (threadIdx.x < MOK_STATUS_WORDS) host[threadIdx.x] = status[threadIdx.x];
}

}  // namespace

MOK_API int mok_host_device_pointer(void* host, void** device) {
  if (host == nullptr || device == nullptr) return MOK_ERR_INVALID_ARGUMENT;
  const cudaError_t err = cudaHostGetDevicePointer(device, host, 0);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: leave no error behind for the next launch's check
    return (int)err;
  }
  return MOK_OK;
}

MOK_API int mok_mirror_status(const int32_t* status, int32_t* host_mapped, cudaStream_t stream) {
  if (status == nullptr || host_mapped == nullptr) return MOK_ERR_INVALID_ARGUMENT;
  mirror_status_kernel<<<1, 32, 0, stream>>>(status, host_mapped);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? MOK_OK : (int)err;
}
