// Timed waits of the forward megakernel, on the primitives of mok/memory_order.cuh (which states
// the scopes: counters between the CTAs of one launch at .gpu scope, the combine-done flags
// between ranks at .sys scope).
//
// Every wait has a %globaltimer deadline. A wait that runs out records MOK_STATUS_TIMEOUT with
// its site and peer in the status word (first one wins, as mok_barrier does) and returns
// false; once a timeout is recorded, every later wait of the rank returns false at once, so
// the whole launch finishes instead of hanging.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "mok/common.h"
#include "mok/memory_order.cuh"

namespace mok {
namespace mega {

// Where a launch reports problems, and how long it waits.
struct Deadline {
  int32_t* status;     // int32 [MOK_STATUS_WORDS]
  int64_t timeout_ns;
  int rank;
};

__device__ __forceinline__ bool timeout_recorded(const int32_t* status) {
  return (ld_volatile(&status[MOK_STATUS_FLAGS]) & MOK_STATUS_TIMEOUT) != 0;
}

__device__ __forceinline__ void record_timeout(const Deadline& d, int site, int peer) {
  const int old = atomicOr(&d.status[MOK_STATUS_FLAGS], MOK_STATUS_TIMEOUT);
  if ((old & MOK_STATUS_TIMEOUT) == 0) {
    atomicExch(&d.status[MOK_STATUS_PEER], peer);
    atomicExch(&d.status[MOK_STATUS_WHERE], site);
    atomicExch(&d.status[MOK_STATUS_RANK], d.rank);
  }
  __threadfence_system();
}

// Spins (one thread) until *counter >= target, with acquire semantics at .gpu scope: the tries
// load relaxed, the wait acquires once when a try has seen the target. Returns false when the
// deadline passed (recorded, blaming this rank: the counters belong to its own launch) or
// another wait of this rank already timed out.
__device__ __forceinline__ bool wait_counter(const int32_t* counter, int32_t target, const Deadline& d,
                                          int site) {
  if (target <= 0 || ld_acquire_gpu(counter) >= target) return true;
  if (timeout_recorded(d.status)) return false;
  const uint64_t start = globaltimer_ns();
  for (uint32_t spin = 1;; ++spin) {
    __nanosleep(32);
    // Coherence: the acquire reads this value or a later one of the (only growing) counter.
    if (ld_relaxed_gpu(counter) >= target) return ld_acquire_gpu(counter) >= target;
    if ((spin & 15u) == 0) {
      if (timeout_recorded(d.status)) return false;
      if ((int64_t)(globaltimer_ns() - start) > d.timeout_ns) {
        record_timeout(d, site, d.rank);
        return false;
      }
    }
  }
}

// The same for a peer's flag at .sys scope: until *flag >= target.
__device__ __forceinline__ bool wait_flag_sys(const uint64_t* flag, uint64_t target, const Deadline& d,
                                           int site, int peer) {
  if (ld_acquire_sys_u64(flag) >= target) return true;
  if (timeout_recorded(d.status)) return false;
  const uint64_t start = globaltimer_ns();
  for (uint32_t spin = 1;; ++spin) {
    __nanosleep(100);
    if (ld_relaxed_sys_u64(flag) >= target) return ld_acquire_sys_u64(flag) >= target;
    if ((spin & 15u) == 0) {
      if (timeout_recorded(d.status)) return false;
      if ((int64_t)(globaltimer_ns() - start) > d.timeout_ns) {
        record_timeout(d, site, peer);
        return false;
      }
    }
  }
}

}  // namespace mega
}  // namespace mok
