// The tile loop: what the producer thread and the consumer warpgroups do for ONE tile.
//
// These are the entry points a persistent kernel calls tile by tile: the TMA thread calls
// load_*_tile(tile) and each consumer warpgroup calls mma_*_tile(tile) followed by an
// epilogue from epilogue.cuh; both sides advance their own PipeState over the same tiles in
// the same order. Nothing here synchronises the CTA, so the caller is free to interleave
// other roles (communication warps, other GEMMs) around them.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "mok/gemm/config.cuh"
#include "mok/gemm/epilogue.cuh"
#include "mok/gemm/pipeline.cuh"
#include "mok/gemm/ptx.cuh"
#include "mok/gemm/scheduler.cuh"
#include "mok/gemm/wgmma.cuh"

namespace mok {
namespace gemm {

// Global operands of a row-grouped GEMM out[R, N] = A[R, K] * B_e for the rows of expert e.
struct RowOperands {
  CUtensorMap map_a;  // A [rows_cap, K] bf16, box {64, BM}, 128-byte swizzle
  CUtensorMap map_b;  // kKMajor/kSwiGLU: [L * N, K], box {64, b_box_rows<Cfg>()};
                      // kMNMajor: [L * K, N], box {64, 64}
  int K;              // reduction length (a multiple of 64)
  int N;              // columns of B per expert (kSwiGLU: 2I)
};

// B boxes of one stage (64 k wide or deep): kSwiGLU takes two boxes of WGN/2 rows per consumer
// warpgroup (the gate rows, then the same up rows); kKMajor one box of WGN rows per warpgroup,
// or two of WGN/2 in a cluster (so the cluster's CTAs can split them); kMNMajor BN/64 boxes of
// 64 columns. Box `idx` goes to `dst` at global coordinates (c0, c1).
template <class Cfg>
constexpr int b_box_rows() {
  return Cfg::kB == BLayout::kKMajor && Cfg::kCluster == 1 ? Cfg::WGN : Cfg::WGN / 2;
}

template <class Cfg>
constexpr int b_boxes() {
  return Cfg::kB == BLayout::kMNMajor ? Cfg::BN / 64 : Cfg::WN * Cfg::WGN / b_box_rows<Cfg>();
}

template <class Cfg>
__device__ __forceinline__ void b_box(const RowOperands& op, const RowTile& t, int k0, int idx,
                                      uint8_t* b, uint8_t*& dst, int& c0, int& c1) {
  if constexpr (Cfg::kB == BLayout::kMNMajor) {
    dst = b + idx * 8192;
    c0 = t.col_block * Cfg::BN + idx * 64;
    c1 = t.expert * op.K + k0;
  } else {
    constexpr int kPerWg = Cfg::WGN / b_box_rows<Cfg>();  // boxes per warpgroup: 1 or 2
    const int wn = idx / kPerWg, part = idx % kPerWg;
    dst = b + wn * Cfg::WGN * 128 + part * b_box_rows<Cfg>() * 128;
    c0 = k0;
    if constexpr (Cfg::kB == BLayout::kSwiGLU) {
      c1 = t.expert * op.N + part * (op.N / 2) + t.col_block * (Cfg::BN / 2) + wn * (Cfg::WGN / 2);
    } else {
      c1 = t.expert * op.N + t.col_block * Cfg::BN + wn * Cfg::WGN + part * b_box_rows<Cfg>();
    }
  }
}

// Producer: all k-blocks of tile t. In a cluster of two (Cfg::kCluster), CTA `rank` loads its
// own A rows and the B boxes of its half, multicast to both CTAs.
template <class Cfg>
__device__ __forceinline__ void load_row_tile(const RowOperands& op, const RowTile& t,
                                              const SmemRing<Cfg>& ring, PipeState& st,
                                              int rank = 0) {
  constexpr int kBoxes = b_boxes<Cfg>();
  static_assert(kBoxes % Cfg::kCluster == 0, "B boxes split evenly over the cluster");
  constexpr int kMine = kBoxes / Cfg::kCluster;
  const int nk = op.K / kBK;
  for (int kb = 0; kb < nk; ++kb) {
    uint64_t* bar = ring.acquire(st, Cfg::kStageBytes);
    const int k0 = kb * kBK;
    tma_load_2d(ring.a(st.stage), &op.map_a, bar, k0, t.row0);
    uint8_t* b = ring.b(st.stage);
#pragma unroll
    for (int j = 0; j < kMine; ++j) {
      uint8_t* dst;
      int c0, c1;
      b_box<Cfg>(op, t, k0, rank * kMine + j, b, dst, c0, c1);
      if constexpr (Cfg::kCluster == 1)
        tma_load_2d(dst, &op.map_b, bar, c0, c1);
      else
        tma_load_2d_multicast(dst, &op.map_b, bar, c0, c1, (1u << Cfg::kCluster) - 1u);
    }
    st.template advance<Cfg::kStages>();
  }
}

// Consumer warpgroup (wm, wn) of the tile: acc = A[rows wm*64 .. +64] * B[cols wn*WGN .. +WGN].
template <class Cfg>
__device__ __forceinline__ void mma_row_tile(const RowOperands& op, int wm, int wn,
                                             const SmemRing<Cfg>& ring,
                                             PipeState& st, float (&acc)[Cfg::kAccRegs]) {
#pragma unroll
  for (int i = 0; i < Cfg::kAccRegs; ++i) acc[i] = 0.f;
  const int nk = op.K / kBK;
  int prev = -1;
  for (int kb = 0; kb < nk; ++kb) {
    ring.wait_full(st);
    const uint32_t a = smem_addr(ring.a(st.stage)) + wm * 64 * 128;
    const uint32_t b = smem_addr(ring.b(st.stage)) + wn * Cfg::WGN * 128;
    fence_registers(acc);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < kBK / 16; ++k) {
      const uint64_t da = make_smem_desc(a + k * 32, 16, 1024);
      const uint64_t db = Cfg::kTransB ? make_smem_desc(b + k * 2048, 8192, 1024)
                                       : make_smem_desc(b + k * 32, 16, 1024);
      if constexpr (Cfg::WGN == 256)
        wgmma_m64n256k16_bf16<0, Cfg::kTransB>(da, db, acc, 1);
      else
        wgmma_m64n128k16_bf16<0, Cfg::kTransB>(da, db, acc, 1);
    }
    wgmma_commit();
    fence_registers(acc);
    wgmma_wait<1>();  // the previous k-block's group is done: its stage can be refilled
    fence_registers(acc);
    if (prev >= 0) ring.release(prev);
    prev = st.stage;
    st.template advance<Cfg::kStages>();
  }
  wgmma_wait<0>();
  fence_registers(acc);
  if (prev >= 0) ring.release(prev);
}

// Global operands of a weight gradient out[e] = A_e^T * B_e (A [rows, M], B [rows, N]) over a
// range of the layout's rows: a and b hold the range's rows from its first (row0) on.
struct WgradOperands {
  CUtensorMap map_a;      // A [rows_cap, M] bf16, box {64, 64}
  CUtensorMap map_b;      // B [rows_cap, N] bf16, box {64, 64}
  int M, N;
  const float* carry_in;  // [M, N] fp32: the partial sum of the segment that spans row0, or null
};

// Producer: the tile's K rows t.row0 .. t.row0 + t.k_rows of a and b (nothing when k_rows = 0).
template <class Cfg>
__device__ __forceinline__ void load_wgrad_tile(const WgradOperands& op, const WgradTile& t,
                                                const SmemRing<Cfg>& ring, PipeState& st) {
  const int nk = t.k_rows / kBK;
  for (int kb = 0; kb < nk; ++kb) {
    uint64_t* bar = ring.acquire(st, Cfg::kStageBytes);
    const int r = t.row0 + kb * kBK;
    uint8_t* a = ring.a(st.stage);
    uint8_t* b = ring.b(st.stage);
#pragma unroll
    for (int j = 0; j < Cfg::BM / 64; ++j) tma_load_2d(a + j * 8192, &op.map_a, bar, t.m0 + j * 64, r);
#pragma unroll
    for (int j = 0; j < Cfg::BN / 64; ++j) tma_load_2d(b + j * 8192, &op.map_b, bar, t.n0 + j * 64, r);
    st.template advance<Cfg::kStages>();
  }
}

// Consumer warpgroup wm (rows wm*64 .. +64 of the output tile, all BN columns). The accumulator
// starts at zero, or at the carried partial sum for a carry-in tile; either way the K blocks
// then run in ascending row order, the order of a launch over the whole segment.
template <class Cfg>
__device__ __forceinline__ void mma_wgrad_tile(const WgradOperands& op, const WgradTile& t, int wm,
                                               const SmemRing<Cfg>& ring, PipeState& st,
                                               float (&acc)[Cfg::kAccRegs]) {
#pragma unroll
  for (int i = 0; i < Cfg::kAccRegs; ++i) acc[i] = 0.f;
  load_wgrad_fp32<Cfg::WGN>(t.carry_in, op.carry_in, op.N, t, wm, acc);
  const int nk = t.k_rows / kBK;
  int prev = -1;
  for (int kb = 0; kb < nk; ++kb) {
    ring.wait_full(st);
    const uint32_t a = smem_addr(ring.a(st.stage)) + wm * 8192;
    const uint32_t b = smem_addr(ring.b(st.stage));
    fence_registers(acc);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < kBK / 16; ++k) {
      const uint64_t da = make_smem_desc(a + k * 2048, 8192, 1024);
      const uint64_t db = make_smem_desc(b + k * 2048, 8192, 1024);
      wgmma_m64n256k16_bf16<1, 1>(da, db, acc, 1);
    }
    wgmma_commit();
    fence_registers(acc);
    wgmma_wait<1>();
    fence_registers(acc);
    if (prev >= 0) ring.release(prev);
    prev = st.stage;
    st.template advance<Cfg::kStages>();
  }
  wgmma_wait<0>();
  fence_registers(acc);
  if (prev >= 0) ring.release(prev);
}

}  // namespace gemm
}  // namespace mok
