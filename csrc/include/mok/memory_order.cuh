// Memory-ordering primitives of the MoK kernels: acquire / release loads and stores, relaxed
// polls, fences and the global timer, each one PTX instruction. Every kernel that hands data
// over between CTAs or ranks uses these (comm.cu's barrier, the megakernel).
//
// The rules they serve:
// - Between the CTAs of one launch (counters): .gpu scope. The writer releases after its data
//   (red.release.gpu), the waiter acquires before it reads (ld.acquire.gpu).
// - Between ranks (flags in peer memory, the combine-done and barrier flags): .sys scope. The
//   writer fences (fence.acq_rel.sys) or releases (st.release.sys) after its data, the reader
//   acquires the flag (ld.acquire.sys) before it reads the data the flag covers.
// - Rows written with generic stores that TMA (the async proxy) reads later: every writing thread
//   issues fence.proxy.async.global before the release, and the reader one after its acquire,
//   before its TMA loads.
// - A poll spins on relaxed loads and acquires once when it has seen the value: on sm_90 every
//   acquire load is followed by an invalidation of the SM's L1, which a spinning acquire would
//   repeat at every try.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace mok {

// %globaltimer in ns (the deadlines of every wait).
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

// A strong load without ordering (a poll's tries; see the rules above).
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

// Makes every write this thread has seen (earlier kernels' included) happen-before its later
// release stores, at system scope (cumulative).
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// Orders this thread's generic-proxy global accesses with later async-proxy (TMA) accesses.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// A load the compiler may not cache or drop (status words, a peer's progress): no ordering.
__device__ __forceinline__ int32_t ld_volatile(const int32_t* p) {
  return *reinterpret_cast<const volatile int32_t*>(p);
}

}  // namespace mok
