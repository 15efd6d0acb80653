// The shared-memory stage ring between the TMA producer and the wgmma consumers.
//
// Stage s has a `full` mbarrier (one arrival by the producer plus the TMA transaction bytes)
// and an `empty` mbarrier (one arrival from every consumer warp once its wgmmas that read the
// stage have completed). Producer and consumers walk the same sequence of (tile, k-block)
// steps, so each side tracks the ring position and the phase parity on its own.
#pragma once

#include <cstdint>

#include "mok/gemm/config.cuh"
#include "mok/gemm/ptx.cuh"

namespace mok {
namespace gemm {

// SmemRing's peers: as many as the launch's cluster has CTAs.
constexpr int kPeersOfLaunch = 0;

struct PipeState {
  int stage = 0;
  uint32_t phase = 0;
  template <int kStages>
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

// Carves the dynamic shared memory of a kernel: stages (1024-byte aligned), the epilogue staging
// buffers of the consumer warpgroups (if any), barriers, and two int32 tables of
// kMaxExperts + 1 entries for the tile schedulers.
template <class Cfg>
struct SmemRing {
  static constexpr int kStages = Cfg::kStages;
  static constexpr int kStageBytes = Cfg::kStageBytes;
  static constexpr int kABytes = Cfg::kABytes;
  uint8_t* base;
  uint64_t* full;
  uint64_t* empty;
  uint64_t* staged_full;   // offloaded epilogues: the consumers' tile is in the staging buffers
  uint64_t* staged_empty;  // ... and the offload warps are done reading it
  int32_t* table0;
  int32_t* table1;
  // CTAs whose consumers release every stage: Cfg::kCluster, or kPeersOfLaunch: the CTAs of
  // the launch's cluster, read at each use (%cluster_nctarank; the megakernel decides at launch
  // whether it runs in clusters of two, and a value kept in a register cost its epilogue a spill).
  int peers;

  __device__ __forceinline__ explicit SmemRing(uint8_t* raw, int peers_ = Cfg::kCluster) : peers(peers_) {
    const uint32_t a = smem_addr(raw);
    base = raw + ((kSmemAlign - (a % kSmemAlign)) % kSmemAlign);
    full = reinterpret_cast<uint64_t*>(base + kStages * kStageBytes +
                                       kConsumerWarpgroups * Cfg::kStagingBytes);
    empty = full + kStages;
    staged_full = full + 2 * kMaxStages;
    staged_empty = staged_full + 1;
    table0 = reinterpret_cast<int32_t*>(staged_full + 2);
    table1 = table0 + kMaxExperts + 1;
  }
  // Epilogue staging buffer of consumer warpgroup cw (1024-byte aligned).
  __device__ __forceinline__ uint8_t* staging(int cw) const {
    return base + kStages * kStageBytes + cw * Cfg::kStagingBytes;
  }
  __device__ __forceinline__ uint8_t* a(int s) const { return base + s * kStageBytes; }
  __device__ __forceinline__ uint8_t* b(int s) const { return base + s * kStageBytes + kABytes; }

  // One thread initialises; the caller synchronises the CTA (or the cluster) afterwards. In a
  // cluster, a stage is refilled only once the consumers of every CTA released it (the peers
  // write into it), so every consumer warp arrives on the empty barrier of each CTA.
  __device__ __forceinline__ void init_barriers() const {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kConsumerWarps * (peers == kPeersOfLaunch ? cluster_size() : peers));
    }
    mbar_init(staged_full, kConsumerWarps);
    mbar_init(staged_empty, kOffloadWarps);
    mbar_fence_init();
  }

  // Producer side: wait until the consumers released the stage, then announce its bytes.
  __device__ __forceinline__ uint64_t* acquire(const PipeState& st, uint32_t bytes) const {
    mbar_wait(&empty[st.stage], st.phase ^ 1u);
    mbar_arrive_expect_tx(&full[st.stage], bytes);
    return &full[st.stage];
  }
  // Consumer side.
  __device__ __forceinline__ void wait_full(const PipeState& st) const {
    mbar_wait(&full[st.stage], st.phase);
  }
  __device__ __forceinline__ void release(int stage) const {
    if (threadIdx.x % 32 == 0) {
      const int n = peers == kPeersOfLaunch ? cluster_size() : peers;
      if (n == 1) {
        mbar_arrive(&empty[stage]);
      } else {
        for (int c = 0; c < n; ++c) mbar_arrive_cluster(&empty[stage], c);
      }
    }
  }
  // Offloaded epilogue, consumer warps: wait until the staging buffers may be written (parity:
  // the consumer's own phase bit, flipped after every tile) ...
  __device__ __forceinline__ void wait_staging_free(uint32_t phase) const {
    mbar_wait(staged_empty, phase ^ 1u);
  }
  // ... and, once the warp's part of the tile is written, hand it over.
  __device__ __forceinline__ void publish_staged() const {
    __syncwarp();
    if (threadIdx.x % 32 == 0) mbar_arrive(staged_full);
  }
  // Offload warps: wait for a staged tile, and give the buffers back once read.
  __device__ __forceinline__ void wait_staged(uint32_t phase) const { mbar_wait(staged_full, phase); }
  __device__ __forceinline__ void release_staged() const {
    __syncwarp();
    if (threadIdx.x % 32 == 0) mbar_arrive(staged_empty);
  }

  // Producer side, after its last tile: wait until every stage it filled was released by all
  // consumers (in a cluster: so no peer still arrives on, or reads, this CTA's shared memory
  // after it exits).
  __device__ __forceinline__ void drain(PipeState st) const {
    for (int i = 0; i < kStages; ++i) {
      mbar_wait(&empty[st.stage], st.phase ^ 1u);
      st.template advance<kStages>();
    }
  }
};

}  // namespace gemm
}  // namespace mok
