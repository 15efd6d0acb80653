// Shared definitions of the MoK C ABI: error codes, the status word, launch checks.
//
// Every entry point returns an int: 0 (MOK_OK) on success, a cudaError_t value (> 0) when a
// CUDA call or launch failed, or one of the negative MOK_ERR_* codes when an argument is
// outside what the kernel supports. mok_error_string() turns any of them into text.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#ifdef __cplusplus
#define MOK_EXTERN_C extern "C"
#else
#define MOK_EXTERN_C
#endif
#define MOK_API MOK_EXTERN_C __attribute__((visibility("default")))

enum MokError {
  MOK_OK = 0,
  MOK_ERR_INVALID_ARGUMENT = -1,   // a size or pointer argument is outside what is supported
  MOK_ERR_UNSUPPORTED = -2,        // a valid configuration this build does not implement
};

// Status word: int32[MOK_STATUS_WORDS], written by kernels when they detect a problem they
// cannot raise themselves (bad routing values, a peer that never arrives). It lives in pinned
// host memory so the host reads it without a device synchronisation.
enum MokStatusIndex {
  MOK_STATUS_FLAGS = 0,      // OR of MokStatusFlag
  MOK_STATUS_VALUE = 1,      // the offending value (bad expert id, token count)
  MOK_STATUS_PEER = 2,       // the peer rank that timed out
  MOK_STATUS_WHERE = 3,      // which wait timed out (MokWaitSite)
  MOK_STATUS_RANK = 4,       // the rank that observed the problem
  MOK_STATUS_WORDS = 8,
};

enum MokStatusFlag {
  MOK_STATUS_BAD_EXPERT_ID = 1,     // an id outside [-1, E)
  MOK_STATUS_TOO_MANY_TOKENS = 2,   // a rank's token count exceeds the workspace capacity
  MOK_STATUS_TIMEOUT = 4,           // a peer did not arrive within the timeout
};

MOK_API const char* mok_error_string(int code);
MOK_API int mok_abi_version(void);

// The device address of pinned host memory (cudaHostGetDevicePointer): an error when the memory
// is not mapped for the current device, and the caller keeps copying with the copy engine.
MOK_API int mok_host_device_pointer(void* host, void** device);

// Queue a kernel that stores the MOK_STATUS_WORDS words of `status` (device) at `host_mapped`
// (a device address of pinned host memory, mok_host_device_pointer): the status mirror of every
// call without a copy-engine copy, whose hand-over back to the compute engine costs the GPU ~8 us
// per call between two calls' kernels (docs/perf-notes.md).
MOK_API int mok_mirror_status(const int32_t* status, int32_t* host_mapped, cudaStream_t stream);
