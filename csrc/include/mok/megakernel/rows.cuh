// Row copies of the megakernel's comm CTAs: a pull copies the 128 rows of a row block (and
// their router weights) from their source ranks into a ring slot, a push copies a block's
// output rows from the ring into their home ranks' (token, slot) rows.
//
// One warp per row, 16-byte vectors, kCopyUnroll loads in flight per lane (86 KB per CTA of
// 384 threads) to cover the NVLink latency. Measured on H200s, a comm CTA moves 45-50 GB/s
// (read + write) with 8 or 14 loads in flight alike, so loads in flight are not what bounds it
// (not profiled yet; TMA bulk copies are the next thing to try). Loads bypass L1
// (ld.global.cg): ring rows are rewritten by other SMs within the launch, and a line cached in
// this SM's L1 from the slot's previous generation must never be read.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "mok/megakernel/plan.cuh"

namespace mok {
namespace mega {

constexpr int kCopyUnroll = 14;  // H = 7168: 896 vectors = two rounds of 14 per lane

__device__ __forceinline__ void copy_row_cg(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                            int vecs, int lane) {
  for (int v0 = lane; v0 < vecs; v0 += 32 * kCopyUnroll) {
    uint4 r[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u)
      if (v0 + 32 * u < vecs) r[u] = __ldcg(src + v0 + 32 * u);
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u)
      if (v0 + 32 * u < vecs) dst[v0 + 32 * u] = r[u];
  }
}

// Where the rows of the symmetric workspace and of the ring are.
struct RowSpaces {
  const uint64_t* bases;    // device [P]: every rank's region
  int64_t rows_offset;      // published bf16 tokens [T_cap, H]
  int64_t scalars_offset;   // published fp32 router weights [T_cap, K]
  int64_t slots_offset;     // bf16 combine slots [T_cap, K, H]
  const int32_t* table;     // schedule [R_cap, 2]
  uint4* ring_x;            // [ring_rows, H / 8]
  float* ring_w;            // [ring_rows]
  uint4* save_x;            // [R_cap, H / 8] or null: the rows again, at their layout row
  float* save_w;            // [R_cap] or null
  int K;
  int vecs;                 // H / 8
};

// The same row into two places (the ring slot and the training copy).
__device__ __forceinline__ void copy_row_cg2(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                             uint4* __restrict__ dst2, int vecs, int lane) {
  for (int v0 = lane; v0 < vecs; v0 += 32 * kCopyUnroll) {
    uint4 r[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u)
      if (v0 + 32 * u < vecs) r[u] = __ldcg(src + v0 + 32 * u);
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u)
      if (v0 + 32 * u < vecs) {
        dst[v0 + 32 * u] = r[u];
        dst2[v0 + 32 * u] = r[u];
      }
  }
}

// Block b into its slot: rows and router weights. Padding rows are not written into the ring:
// a GEMM output row depends only on its own input row, the SwiGLU epilogue stores zeros for
// padding rows and nothing pushes them. With the training copy (save_x, save_w), the rows and
// weights go there too, at their layout rows, and padding rows there are zeroed (the backward's
// weight gradients sum over them). Warps `warp` of `warps` take rows warp, warp + warps, ...
__device__ __forceinline__ void pull_block(const RowSpaces& rs, int block, int slot, int warp, int warps,
                                           int lane) {
  for (int r = warp; r < kBlockRows; r += warps) {
    const int64_t i = (int64_t)block * kBlockRows + r;
    const int s = rs.table[2 * i];
    const int route = rs.table[2 * i + 1];
    if (s < 0) {
      if (rs.save_x != nullptr) {
        uint4* z = rs.save_x + i * rs.vecs;
        for (int v = lane; v < rs.vecs; v += 32) z[v] = make_uint4(0u, 0u, 0u, 0u);
        if (lane == 0) rs.save_w[i] = 0.f;
      }
      continue;
    }
    const int64_t ring_row = (int64_t)slot * kBlockRows + r;
    uint4* dst = rs.ring_x + ring_row * rs.vecs;
    const char* base = reinterpret_cast<const char*>(rs.bases[s]);
    const uint4* src = reinterpret_cast<const uint4*>(base + rs.rows_offset) + (int64_t)(route / rs.K) * rs.vecs;
    if (rs.save_x != nullptr)
      copy_row_cg2(src, dst, rs.save_x + i * rs.vecs, rs.vecs, lane);
    else
      copy_row_cg(src, dst, rs.vecs, lane);
    if (lane == 0) {
      const float w = __ldcg(reinterpret_cast<const float*>(base + rs.scalars_offset) + route);
      rs.ring_w[ring_row] = w;
      if (rs.save_w != nullptr) rs.save_w[i] = w;
    }
  }
}

// Block b's output rows (in its slot) to their (token, slot) on their home ranks.
__device__ __forceinline__ void push_block(const RowSpaces& rs, int block, int slot, int warp, int warps,
                                           int lane) {
  for (int r = warp; r < kBlockRows; r += warps) {
    const int64_t i = (int64_t)block * kBlockRows + r;
    const int s = rs.table[2 * i];
    if (s < 0) continue;
    const int route = rs.table[2 * i + 1];
    const uint4* src = rs.ring_x + ((int64_t)slot * kBlockRows + r) * rs.vecs;
    char* base = reinterpret_cast<char*>(rs.bases[s]);
    uint4* dst = reinterpret_cast<uint4*>(base + rs.slots_offset) + (int64_t)route * rs.vecs;
    copy_row_cg(src, dst, rs.vecs, lane);
  }
}

}  // namespace mega
}  // namespace mok
