// Memory-ordering primitives and timed waits of the forward megakernel.
//
// Scopes (DESIGN.md section 8): counters between the CTAs of one launch use .gpu scope
// (release by the writer after its data, acquire by the waiter before it reads); the
// "combine done" flags between ranks use .sys scope. Rows written with ordinary stores that
// TMA (the async proxy) reads later need fence.proxy.async.global in every writing thread
// before the release, and the waiter issues one after its acquire, before its TMA loads.
//
// Every wait has a %globaltimer deadline. A wait that runs out records MOK_STATUS_TIMEOUT with
// its site and peer in the status word (first one wins, as mok_barrier does) and returns
// false; once a timeout is recorded, every later wait of the rank returns false at once, so
// the whole launch finishes instead of hanging.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "mok/common.h"

namespace mok {
namespace mega {

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ int32_t ld_acquire_gpu(const int32_t* p) {
  int32_t v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// A strong load without ordering: on sm_90 an acquire load is followed by an invalidation of the
// SM's L1 (CCTL.IVALL in the SASS); a poll that spins on relaxed loads and acquires once, after
// it has seen the value, invalidates once per wait instead of once per try.
__device__ __forceinline__ int32_t ld_relaxed_gpu(const int32_t* p) {
  int32_t v;
  asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void red_release_gpu_add(int32_t* p, int32_t v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ int32_t atom_add_acq_rel_gpu(int32_t* p, int32_t v) {
  int32_t old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

__device__ __forceinline__ uint64_t ld_acquire_sys_u64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t ld_relaxed_sys_u64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// Orders this thread's generic-proxy global accesses with later async-proxy (TMA) accesses.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

__device__ __forceinline__ int32_t ld_volatile(const int32_t* p) {
  return *reinterpret_cast<const volatile int32_t*>(p);
}

// Where a launch reports problems, and how long and how it waits.
struct Deadline {
  int32_t* status;     // int32 [MOK_STATUS_WORDS]
  int64_t timeout_ns;
  int rank;
  int relaxed_polls;   // 1: a wait's repeated tries load relaxed and the wait acquires once at the end
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

// Spins (one thread) until *counter >= target, with acquire semantics at .gpu scope. Returns
// false when the deadline passed (recorded, blaming this rank: the counters belong to its own
// launch) or another wait of this rank already timed out.
__device__ __forceinline__ bool wait_counter(const int32_t* counter, int32_t target, const Deadline& d,
                                          int site) {
  if (target <= 0 || ld_acquire_gpu(counter) >= target) return true;
  if (timeout_recorded(d.status)) return false;
  const uint64_t start = globaltimer_ns();
  for (uint32_t spin = 1;; ++spin) {
    __nanosleep(32);
    if (d.relaxed_polls) {
      // Coherence: the acquire reads this value or a later one of the (only growing) counter.
      if (ld_relaxed_gpu(counter) >= target) return ld_acquire_gpu(counter) >= target;
    } else if (ld_acquire_gpu(counter) >= target) {
      return true;
    }
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
    if (d.relaxed_polls) {
      if (ld_relaxed_sys_u64(flag) >= target) return ld_acquire_sys_u64(flag) >= target;
    } else if (ld_acquire_sys_u64(flag) >= target) {
      return true;
    }
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
