// Error strings and ABI version of the MoK library.
#include <cuda_runtime.h>

#include "mok/common.h"

// Bumped whenever an exported signature changes; the Python side checks it at load time.
static constexpr int kAbiVersion = 1;

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
