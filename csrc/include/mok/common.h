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
// cannot raise themselves (bad routing values, a peer that never arrives, a peer that stopped).
// Each call mirrors it into pinned host memory, so the host reads it without a device
// synchronisation.
enum MokStatusIndex {
  MOK_STATUS_FLAGS = 0,      // OR of MokStatusFlag
  MOK_STATUS_VALUE = 1,      // the offending value (bad expert id, token count)
  MOK_STATUS_PEER = 2,       // the peer rank that timed out, or the rank that stopped (PEER_FAILED)
  MOK_STATUS_WHERE = 3,      // which wait timed out or learned of the stopped peer (a site number)
  MOK_STATUS_RANK = 4,       // the rank that observed the problem
  MOK_STATUS_FAILURE = 5,    // with MOK_STATUS_PEER_FAILED: why that rank stopped (MokFailureCode)
  MOK_STATUS_SOURCE = 6,     // the rank whose ids or token count held the bad value
  MOK_STATUS_WORDS = 8,
};

enum MokStatusFlag {
  MOK_STATUS_BAD_EXPERT_ID = 1,     // an id outside [-1, E)
  MOK_STATUS_TOO_MANY_TOKENS = 2,   // a rank's token count exceeds the workspace capacity
  MOK_STATUS_TIMEOUT = 4,           // a peer did not arrive within the timeout (also set with PEER_FAILED)
  MOK_STATUS_PEER_FAILED = 8,       // a rank of the group stopped (its failure word is set)
};

// Failure words. Each rank's signal array is uint64 [2P]: the barrier and combine-done flags
// [P], then one failure word per peer [P]. A rank that stops (its own checks failed before it
// queued a call: mok_signal_failure; or one of its barrier waits timed out) stores
// MOK_FAILURE_WORD(code, rank) into its failure word in every peer's array, and records the
// failure in its own status word. A barrier that finds a peer's failure word set records
// MOK_STATUS_PEER_FAILED (with MOK_STATUS_TIMEOUT, so that every later wait of the rank,
// the megakernel's included, returns at once and the outputs are NaN) and returns. Failure
// words are never cleared: the workspace is unusable after a failure, as after a timeout.
enum MokFailureCode {
  MOK_FAILURE_INPUT = 1,     // its arguments failed mok_moe's checks (MoKInputError)
  MOK_FAILURE_CONFIG = 2,    // its configuration failed (MoKConfigError, MoKMismatchError)
  MOK_FAILURE_BACKEND = 3,   // the backend could not run there (BackendUnavailable)
  MOK_FAILURE_CAPACITY = 4,  // more tokens than the workspace holds (MoKCapacityError)
  MOK_FAILURE_TIMEOUT = 5,   // it waited for a peer past the timeout
  MOK_FAILURE_PEER = 6,      // it learned that another rank had stopped
  MOK_FAILURE_OTHER = 7,
};
#define MOK_FAILURE_WORD(code, rank) \
  ((1ull << 63) | ((uint64_t)(uint32_t)(code) << 32) | (uint64_t)(uint32_t)(rank))

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
