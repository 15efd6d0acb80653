// Row copies of the megakernel's pull crews (crews.cuh): a pull copies the 128 rows of a row
// block, or 16 of them (a part of a first block, plan.cuh), and their router weights from their
// source ranks into a ring slot. (The output rows go home from fc2's epilogue: push.cuh.)
//
// Two ways to move a row, by who copies:
//
// - Bulk, a whole CTA (the first pulls, when its stage area holds no tile yet): each warp
//   streams its rows through a private ring of kCopyStages shared-memory chunks of
//   kCopyChunkBytes. Lane 0 issues TMA bulk copies: global -> shared (cp.async.bulk,
//   completion counted in bytes on the stage's mbarrier), then shared -> global
//   (cp.async.bulk bulk_group; a pull stores the chunk twice when the training copy is on).
//   kCopyStages - 1 loads stay in flight per warp while the oldest chunk is stored, so a CTA
//   keeps ~144 KB in flight without holding any of it in registers, and the row addresses are
//   read once per block by the warp's lanes (no dependent table read per row).
// - Registers, the pull helpers (three warps of a compute CTA, whose GEMM owns the stage area):
//   one warp per row, 16-byte vectors, kCopyUnroll loads in flight per lane.
//
// Memory ordering. Rows that TMA reads after bulk or generic stores (a pull's rows, read by
// fc1's TMA) are ordered by fence.proxy.async.global on both sides of the counter hand-over;
// bulk stores are waited for (cp.async.bulk.wait_group 0) before the hand-over that publishes
// them. Peers' rows are not rewritten during the launch, so the loads may go through any cache.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "mok/gemm/ptx.cuh"
#include "mok/megakernel/plan.cuh"
#include "mok/megakernel/sync.cuh"

namespace mok {
namespace mega {

constexpr int kCopyUnroll = 14;  // H = 7168: 896 vectors = two rounds of 14 per lane

// Bulk copies: per-warp shared-memory ring (a whole CTA's first pulls reuse the GEMM stage area).
constexpr int kCopyWarps = 12;
constexpr int kCopyStages = 4;
constexpr int kCopyChunkBytes = 4096;
constexpr int kCopyWarpBytes = kCopyStages * kCopyChunkBytes;

// Where the rows of the symmetric workspace and of the ring are.
struct RowSpaces {
  const uint64_t* bases;    // device [P]: every rank's region
  int64_t rows_offset;      // published bf16 tokens [T_cap, H]
  int64_t scalars_offset;   // published fp32 router weights [T_cap, K]
  const int32_t* table;     // schedule [R_cap, 2]
  uint4* ring_x;            // [ring_rows, H / 8]
  float* ring_w;            // [ring_rows]
  uint4* save_x;            // [save_rows, H / 8] or null: the rows again, at their layout row
  float* save_w;            // [save_rows] or null
  int64_t save_rows;        // layout rows kept in save_x and save_w (a multiple of kBlockRows)
  int K;
  int vecs;                 // H / 8
};

// One warp's bulk-copy pipeline: its shared-memory chunks, their mbarriers (count 1), and how
// many chunks it has loaded so far (chunk g uses stage g % kCopyStages, phase (g / S) & 1).
struct CopyPipe {
  uint8_t* chunks;   // kCopyStages * kCopyChunkBytes bytes
  uint64_t* bars;    // kCopyStages mbarriers
  uint32_t loaded;
};

// ---- PTX: bulk copies ------------------------------------------------------------------------

__device__ __forceinline__ void bulk_load(void* dst_smem, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          gemm::smem_addr(dst_smem)),
      "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(gemm::smem_addr(bar))
      : "memory");
}

__device__ __forceinline__ void bulk_store(void* dst, const void* src_smem, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(reinterpret_cast<uint64_t>(dst)),
               "r"(gemm::smem_addr(src_smem)), "r"(bytes)
               : "memory");
}

// Waits until all but the newest bulk group of this thread have read their shared memory.
__device__ __forceinline__ void bulk_wait_read_all_but_newest() {
  asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
}

// ---- register copies -------------------------------------------------------------------------

// One row (vecs 16-byte vectors) into dst, and into dst2 unless it is null.
__device__ __forceinline__ void copy_row_cg(const uint4* __restrict__ src, uint4* __restrict__ dst,
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
        if (dst2 != nullptr) dst2[v0 + 32 * u] = r[u];
      }
  }
}

// ---- bulk row streams ------------------------------------------------------------------------

// Copies the rows the warp's lanes describe (lane k: src, dst, dst2 (may be null), `valid`),
// each row_bytes long, cut into chunks of kCopyChunkBytes, through the warp's pipe. All lanes
// call it (the loop is warp-uniform); lane 0 issues the copies. On return every chunk has been
// loaded and its stores are complete (visible to TMA and generic readers after the caller's
// hand-over).
__device__ __forceinline__ void stream_rows(CopyPipe& pipe, const char* src, char* dst, char* dst2, bool valid,
                                            int row_bytes, int lane) {
  const uint32_t mask = __ballot_sync(~0u, valid);
  const int order = __popc(mask & ((1u << lane) - 1u));  // this lane's place among the valid rows
  const int pieces = (row_bytes + kCopyChunkBytes - 1) / kCopyChunkBytes;
  const int n = __popc(mask) * pieces;
  if (lane == 0) fence_proxy_async_global();  // after the item's acquire, before bulk accesses

  struct Chunk {
    const char* src;
    char* dst;
    char* dst2;
    uint32_t bytes;
  };
  auto chunk = [&](int j) {  // warp-uniform: every lane calls it with the same j
    const int q = j / pieces, piece = j % pieces;
    const int owner = __ffs(__ballot_sync(~0u, valid && order == q)) - 1;
    const int64_t off = (int64_t)piece * kCopyChunkBytes;
    Chunk c;
    c.src = reinterpret_cast<const char*>(__shfl_sync(~0u, reinterpret_cast<uint64_t>(src), owner)) + off;
    c.dst = reinterpret_cast<char*>(__shfl_sync(~0u, reinterpret_cast<uint64_t>(dst), owner)) + off;
    const uint64_t d2 = __shfl_sync(~0u, reinterpret_cast<uint64_t>(dst2), owner);
    c.dst2 = d2 ? reinterpret_cast<char*>(d2) + off : nullptr;
    c.bytes = (uint32_t)min((int64_t)kCopyChunkBytes, (int64_t)row_bytes - off);
    return c;
  };
  auto issue_load = [&](int j) {
    const Chunk c = chunk(j);
    if (lane == 0) {
      const uint32_t g = pipe.loaded + j;
      uint64_t* bar = &pipe.bars[g % kCopyStages];
      gemm::mbar_arrive_expect_tx(bar, c.bytes);
      bulk_load(pipe.chunks + (g % kCopyStages) * kCopyChunkBytes, c.src, c.bytes, bar);
    }
  };

  for (int j = 0; j < kCopyStages - 1 && j < n; ++j) issue_load(j);
  for (int j = 0; j < n; ++j) {
    const Chunk c = chunk(j);
    if (lane == 0) {
      const uint32_t g = pipe.loaded + j;
      const int stage = g % kCopyStages;
      gemm::mbar_wait(&pipe.bars[stage], (g / kCopyStages) & 1u);
      uint8_t* data = pipe.chunks + stage * kCopyChunkBytes;
      bulk_store(c.dst, data, c.bytes);
      if (c.dst2 != nullptr) bulk_store(c.dst2, data, c.bytes);
      gemm::bulk_commit();
      // The stage chunk j + S - 1 reuses is chunk j - 1's: its stores must have read it.
      if (j + kCopyStages - 1 < n) bulk_wait_read_all_but_newest();
    }
    if (j + kCopyStages - 1 < n) issue_load(j + kCopyStages - 1);
  }
  pipe.loaded += n;
  if (lane == 0) {
    gemm::bulk_wait();
    fence_proxy_async_global();  // TMA and generic readers after the hand-over
  }
  __syncwarp();
}

// ---- pulls --------------------------------------------------------------------------------------

// The rows [row0, row0 + rows) of a block that a copy item moves: a whole block, or a part of a
// first block (plan.cuh).
struct RowRange {
  int row0, rows;
};
constexpr RowRange kWholeBlock{0, kBlockRows};

// With bulk copies, lane k of a copy warp describes the warp's k-th row of the item (warps >= 4,
// so at most 32 rows per warp): its row r in the block, its layout row i, and its table entry
// (source rank s, -1 for padding and for lanes past the item; route = token * K + slot there).
struct LaneRow {
  int r;
  int64_t i;
  bool in_block;
  int s, route;
  __device__ __forceinline__ LaneRow(const RowSpaces& rs, int block, RowRange range, int warp, int warps, int lane)
      : r(range.row0 + warp + lane * warps), i((int64_t)block * kBlockRows + r),
        in_block(r < range.row0 + range.rows), s(in_block ? rs.table[2 * i] : -1),
        route(in_block ? rs.table[2 * i + 1] : 0) {}
};

// Rows `range` of block b into its slot: rows and router weights. Padding rows are not written
// into the ring: a GEMM output row depends only on its own input row, the SwiGLU epilogue stores
// zeros for padding rows and nothing pushes them. With the training copy (save_x, save_w), the
// rows and weights of a block in its kept prefix (layout rows < save_rows) go there too, at their
// layout rows, and padding rows there are zeroed (the backward's weight gradients sum over
// them); a block past the prefix goes to the ring only. Warps `warp` of `warps` take rows
// row0 + warp, row0 + warp + warps, ... With `pipe` (bulk copies) the rows are complete in
// global memory on return.
__device__ __forceinline__ void pull_rows(const RowSpaces& rs, int block, RowRange range, int slot, int warp,
                                          int warps, int lane, CopyPipe* pipe) {
  // save_rows is a multiple of kBlockRows: the block is kept whole or not at all.
  const bool keep = (int64_t)(block + 1) * kBlockRows <= rs.save_rows;
  uint4* const save_x = keep ? rs.save_x : nullptr;
  float* const save_w = keep ? rs.save_w : nullptr;
  if (pipe != nullptr) {
    const LaneRow lr(rs, block, range, warp, warps, lane);
    const int r = lr.r, s = lr.s, route = lr.route;
    const int64_t i = lr.i;
    const bool in_block = lr.in_block;
    const int64_t row_bytes = (int64_t)rs.vecs * 16;
    const int64_t ring_row = (int64_t)slot * kBlockRows + r;
    const char* src = nullptr;
    if (s >= 0) {
      const char* base = reinterpret_cast<const char*>(rs.bases[s]);
      src = base + rs.rows_offset + (int64_t)(route / rs.K) * row_bytes;
      const float w = __ldcg(reinterpret_cast<const float*>(base + rs.scalars_offset) + route);
      rs.ring_w[ring_row] = w;
      if (save_w != nullptr) save_w[i] = w;
    } else if (in_block && save_w != nullptr) {
      save_w[i] = 0.f;
    }
    char* dst = reinterpret_cast<char*>(rs.ring_x) + ring_row * row_bytes;
    char* dst2 = save_x != nullptr ? reinterpret_cast<char*>(save_x) + i * row_bytes : nullptr;
    stream_rows(*pipe, src, dst, dst2, s >= 0, (int)row_bytes, lane);
    if (save_x != nullptr) {  // padding rows of the training copy: zeros
      uint32_t padding = __ballot_sync(~0u, in_block && s < 0);
      while (padding) {
        const int k = __ffs(padding) - 1;
        padding &= padding - 1;
        uint4* z = save_x + ((int64_t)block * kBlockRows + range.row0 + warp + k * warps) * rs.vecs;
        for (int v = lane; v < rs.vecs; v += 32) z[v] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    return;
  }
  for (int r = range.row0 + warp; r < range.row0 + range.rows; r += warps) {
    const int64_t i = (int64_t)block * kBlockRows + r;
    const int s = rs.table[2 * i];
    const int route = rs.table[2 * i + 1];
    if (s < 0) {
      if (save_x != nullptr) {
        uint4* z = save_x + i * rs.vecs;
        for (int v = lane; v < rs.vecs; v += 32) z[v] = make_uint4(0u, 0u, 0u, 0u);
        if (lane == 0) save_w[i] = 0.f;
      }
      continue;
    }
    const int64_t ring_row = (int64_t)slot * kBlockRows + r;
    const char* base = reinterpret_cast<const char*>(rs.bases[s]);
    const uint4* src = reinterpret_cast<const uint4*>(base + rs.rows_offset) + (int64_t)(route / rs.K) * rs.vecs;
    copy_row_cg(src, rs.ring_x + ring_row * rs.vecs, save_x != nullptr ? save_x + i * rs.vecs : nullptr,
                rs.vecs, lane);
    if (lane == 0) {
      const float w = __ldcg(reinterpret_cast<const float*>(base + rs.scalars_offset) + route);
      rs.ring_w[ring_row] = w;
      if (save_w != nullptr) save_w[i] = w;
    }
  }
}

}  // namespace mega
}  // namespace mok
