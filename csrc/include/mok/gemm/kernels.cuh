// The standalone persistent kernels: one CTA per SM, each walking its share of the tile
// sequence with the tile loop of mainloop.cuh and an epilogue of epilogue.cuh.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "mok/gemm/config.cuh"
#include "mok/gemm/epilogue.cuh"
#include "mok/gemm/mainloop.cuh"
#include "mok/gemm/pipeline.cuh"
#include "mok/gemm/scheduler.cuh"

namespace mok {
namespace gemm {

template <class Epi>
struct RowKernelParams {
  RowOperands op;
  typename Epi::Params epi;
  const int32_t* offsets;  // [L + 1]
  const int32_t* counts;   // [L] or null
  int L;
  int num_cb;              // column blocks
  int64_t rows_cap;
};

// The three roles of a row-GEMM CTA over its tiles t = first, first + step, ... < total
// (tile_at(t): the tile with linear index t; rank: the CTA's rank in its cluster). Warpgroup 0's
// first thread issues the TMA loads; with an offloaded epilogue its other three warps run the
// epilogue on the tiles the consumers staged; warpgroups 1 and 2 multiply.
template <class Cfg, class Epi, class TileAt>
__device__ __forceinline__ void run_row_roles(const RowKernelParams<Epi>& p,
                                              const SmemRing<Cfg>& ring, int first, int step,
                                              int total, const TileAt& tile_at, int rank) {
  static_assert(!Epi::kOffload || Cfg::kStagingBytes == Cfg::WGN * 128,
                "an offloaded epilogue reads the consumers' bf16 tiles from the staging buffers");
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    setmaxnreg_dec<Epi::kOffload ? kOffloadProducerRegisters : kProducerRegisters>();
    if (threadIdx.x == 0) {
      PipeState st;
      tma_prefetch_descriptor(&p.op.map_a);
      tma_prefetch_descriptor(&p.op.map_b);
      for (int t = first; t < total; t += step) load_row_tile<Cfg>(p.op, tile_at(t), ring, st, rank);
      if constexpr (Cfg::kCluster > 1) ring.drain(st);
    } else if constexpr (Epi::kOffload) {
      if (threadIdx.x < 32) return;
      uint32_t phase = 0;
      for (int t = first; t < total; t += step) {
        const RowTile tile = tile_at(t);
        if (!tile.valid) continue;
        ring.wait_staged(phase);
        Epi::template offload<Cfg>(p.epi, tile, ring.staging(0), threadIdx.x / 32 - 1);
        ring.release_staged();
        phase ^= 1u;
      }
    }
  } else {
    setmaxnreg_inc<Epi::kOffload ? kOffloadConsumerRegisters : kConsumerRegisters>();
    const int cw = wg - 1;
    const int wm = cw % Cfg::WM, wn = cw / Cfg::WM;
    PipeState st;
    uint32_t phase = 0;
    float acc[Cfg::kAccRegs];
    for (int t = first; t < total; t += step) {
      const RowTile tile = tile_at(t);
      mma_row_tile<Cfg>(p.op, wm, wn, ring, st, acc);
      if (!tile.valid) continue;
      if constexpr (Epi::kOffload) {
        ring.wait_staging_free(phase);
        stage_tile<Cfg::WGN>(ring.staging(cw), acc);
        ring.publish_staged();
        phase ^= 1u;
      } else {
        Epi::template apply<Cfg::WGN>(p.epi, tile, wm, wn, Cfg::BN, acc, ring.staging(cw), cw);
      }
    }
    if constexpr (!Epi::kOffload) Epi::finish(cw);
  }
}

template <class Cfg, class Epi>
__global__ void __launch_bounds__(kThreads, 1)
    row_gemm_kernel(const __grid_constant__ RowKernelParams<Epi> p) {
  extern __shared__ uint8_t smem_raw[];
  const SmemRing<Cfg> ring(smem_raw);
  if (threadIdx.x == 0) ring.init_barriers();
  for (int i = threadIdx.x; i <= p.L; i += blockDim.x) ring.table0[i] = p.offsets[i];
  __syncthreads();
  if constexpr (Cfg::kCluster == 1) {
    const RowScheduler sched(ring.table0, p.counts, p.L, Cfg::BM, p.num_cb, p.rows_cap);
    run_row_roles<Cfg, Epi>(p, ring, blockIdx.x, gridDim.x, sched.total,
                            [&](int t) { return sched.tile(t); }, 0);
  } else {
    // Clusters of two: both CTAs walk the same pair tiles, CTA `rank` the rank-th row block.
    if (threadIdx.x == 0)
      PairRowScheduler::build_pair_starts(ring.table0, ring.table1, p.L, Cfg::BM, p.num_cb,
                                          p.rows_cap);
    cluster_sync();  // barriers initialised and tables built in both CTAs
    const PairRowScheduler sched(ring.table0, ring.table1, p.counts, p.L, Cfg::BM, p.num_cb);
    const int rank = static_cast<int>(cluster_rank());
    run_row_roles<Cfg, Epi>(p, ring, blockIdx.x / Cfg::kCluster, gridDim.x / Cfg::kCluster,
                            sched.total, [&](int t) { return sched.tile(t, rank); }, rank);
  }
}

template <class Epi>
struct WgradKernelParams {
  WgradOperands op;
  typename Epi::Params epi;
  const int32_t* offsets;  // [L + 1], the whole layout's
  const int32_t* counts;   // [L] real rows per expert (the K loops skip padding blocks), or null
  int L;
  int row0, row1;          // the launch's layout rows (multiples of 64; row0 == row1: none)
};

// Weight gradients of the experts with a part in the layout rows [row0, row1): a segment that
// began before row0 starts from op.carry_in, one that goes on past row1 ends in epi.carry_out
// (when given); experts with no part in the range get no tile (see WgradScheduler).
template <class Cfg, class Epi>
__global__ void __launch_bounds__(kThreads, 1)
    wgrad_kernel(const __grid_constant__ WgradKernelParams<Epi> p) {
  extern __shared__ uint8_t smem_raw[];
  const SmemRing<Cfg> ring(smem_raw);
  if (threadIdx.x == 0) ring.init_barriers();
  for (int i = threadIdx.x; i <= p.L; i += blockDim.x) ring.table0[i] = p.offsets[i];
  __syncthreads();
  WgradScheduler::build_order(ring.table0, p.counts, ring.table1, p.L, p.row0, p.row1);
  __syncthreads();
  const WgradScheduler sched(ring.table0, ring.table1, p.L, p.op.M / Cfg::BM, p.op.N / Cfg::BN,
                             p.row0, p.row1, p.epi.carry_out != nullptr);
  const int wg = threadIdx.x / 128;
  PipeState st;
  if (wg == 0) {
    setmaxnreg_dec<kProducerRegisters>();
    if (threadIdx.x == 0) {
      if (p.row1 > p.row0) {  // no rows: the operand maps were not encoded
        tma_prefetch_descriptor(&p.op.map_a);
        tma_prefetch_descriptor(&p.op.map_b);
      }
      for (int t = blockIdx.x; t < sched.total; t += gridDim.x)
        load_wgrad_tile<Cfg>(p.op, sched.tile(t, Cfg::BM, Cfg::BN), ring, st);
    }
  } else {
    setmaxnreg_inc<kConsumerRegisters>();
    const int wm = wg - 1;
    float acc[Cfg::kAccRegs];
    for (int t = blockIdx.x; t < sched.total; t += gridDim.x) {
      const WgradTile tile = sched.tile(t, Cfg::BM, Cfg::BN);
      mma_wgrad_tile<Cfg>(p.op, tile, wm, ring, st, acc);
      Epi::template apply<Cfg::WGN>(p.epi, tile, wm, acc, ring.staging(wm), wm);
    }
    Epi::finish(wm);
  }
}

}  // namespace gemm
}  // namespace mok
