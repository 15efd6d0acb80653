// Device-side schedule builder (see mok/schedule.h for the table's definition).
//
// The routes of all ranks, concatenated in rank order, are cut into "units" of kUnitRoutes
// consecutive routes; a unit is one warp's work. Units never straddle ranks, so unit u
// belongs to rank u / units_per_rank. Three launches:
//   1. histogram: each warp counts its unit's routes per local expert -> scratch[u][l];
//   2. scan (one block): per expert, the exclusive prefix over units in order, then the
//      padded segment offsets; padding rows of the table are set to -1;
//   3. place: each warp walks its unit again, 32 routes at a time; lanes with the same
//      expert find their order with __match_any_sync, so each route lands at
//      offsets[l] + (routes of earlier units) + (earlier routes of this unit).
// The order is therefore (source rank, token, slot) within every expert: deterministic.
// The three are latency-bound (half the ids are a peer's, over NVLink): each lane loads all of
// its unit's ids (kRoutesPerLane) before it uses one, and the scan reads a chunk of an expert's
// unit counts before it rewrites them, so each kernel waits for a few round trips instead of
// one per 32 routes or per unit (54 us for the three at 4096 tokens, top-8, P = 2 before).
#include <cuda_runtime.h>

#include "mok/cuda_check.cuh"
#include "mok/schedule.h"

namespace {

constexpr int kUnitRoutes = 512;
constexpr int kWarp = 32;
constexpr int kScanThreads = 1024;
constexpr int kRoutesPerLane = kUnitRoutes / kWarp;
constexpr int kScanChunk = 16;  // unit counts of one expert read before they are rewritten

struct Geometry {
  int P, max_tokens, K, L, rank;
  int units_per_rank;  // ceil(max_tokens * K / kUnitRoutes), at least 1
};

// Record a bad value of source rank `source` (first one wins the detail words). Every rank's
// schedule reads every rank's ids and token count, so every rank records it, naming the source.
__device__ inline void report_from(int32_t* status, int flag, int value, int rank, int source) {
  if (status == nullptr) return;
  const int old = atomicOr(&status[MOK_STATUS_FLAGS], flag);
  if ((old & flag) == 0) {
    atomicExch(&status[MOK_STATUS_VALUE], value);
    atomicExch(&status[MOK_STATUS_RANK], rank);
    atomicExch(&status[MOK_STATUS_SOURCE], source);
  }
}

__device__ inline int tokens_of(const int32_t* const* ntok_ptrs, int s, int max_tokens,
                                int32_t* status, int rank) {
  int t = *ntok_ptrs[s];
  if (t < 0 || t > max_tokens) {
    report_from(status, MOK_STATUS_TOO_MANY_TOKENS, t, rank, s);
    t = t < 0 ? 0 : max_tokens;
  }
  return t;
}

// Local expert of the route, or -1 when the route is unused or belongs to another rank.
__device__ inline int local_expert(int64_t id, int first_expert, int L, int num_experts,
                                   int32_t* status, int rank, int source, bool report) {
  if (id < -1 || id >= num_experts) {
    // The value word is int32: an id beyond it is recorded saturated.
    const int value = id > INT32_MAX ? INT32_MAX : (id < INT32_MIN ? INT32_MIN : (int)id);
    if (report) report_from(status, MOK_STATUS_BAD_EXPERT_ID, value, rank, source);
    return -1;
  }
  int64_t l = id - first_expert;
  return (id >= 0 && l >= 0 && l < L) ? (int)l : -1;
}

// The ids of a unit's routes [begin, end) for lane threadIdx.x of a one-warp block: id[j] is
// route begin + 32 j + lane (-1 past the end). All loads are issued before any is used.
__device__ inline void load_unit_ids(const int64_t* ids, int begin, int end,
                                     int64_t (&id)[kRoutesPerLane]) {
#pragma unroll
  for (int j = 0; j < kRoutesPerLane; ++j) {
    const int r = begin + j * kWarp + (int)threadIdx.x;
    id[j] = r < end ? ids[r] : -1;
  }
}

__global__ void histogram_kernel(const int64_t* const* ids_ptrs, const int32_t* const* ntok_ptrs,
                                 Geometry g, int32_t* scratch, int32_t* status) {
  extern __shared__ int32_t hist[];  // [L]
  const int unit = blockIdx.x;
  const int s = unit / g.units_per_rank;
  const int begin = (unit % g.units_per_rank) * kUnitRoutes;
  for (int l = threadIdx.x; l < g.L; l += blockDim.x) hist[l] = 0;
  __syncwarp();
  const int routes = tokens_of(ntok_ptrs, s, g.max_tokens, status, g.rank) * g.K;
  const int end = min(begin + kUnitRoutes, routes);
  int64_t id[kRoutesPerLane];
  load_unit_ids(ids_ptrs[s], begin, end, id);
  const int first = g.rank * g.L;
#pragma unroll
  for (int j = 0; j < kRoutesPerLane; ++j) {
    if (begin + j * kWarp + (int)threadIdx.x >= end) break;
    int l = local_expert(id[j], first, g.L, g.P * g.L, status, g.rank, s, /*report=*/true);
    if (l >= 0) atomicAdd(&hist[l], 1);  // integer counts: order-independent
  }
  __syncwarp();
  for (int l = threadIdx.x; l < g.L; l += blockDim.x) scratch[(int64_t)unit * g.L + l] = hist[l];
}

__global__ void __launch_bounds__(kScanThreads)
    scan_kernel(Geometry g, int tile_rows, int num_units, int32_t* scratch, int32_t* counts,
                int32_t* offsets, int32_t* table) {
  __shared__ int32_t carry;
  __shared__ int32_t warp_sums[kScanThreads / kWarp];
  // Per expert: exclusive prefix over units (in rank, then route order).
  for (int l = threadIdx.x; l < g.L; l += blockDim.x) {
    int32_t running = 0;
    for (int u0 = 0; u0 < num_units; u0 += kScanChunk) {
      int32_t v[kScanChunk];
#pragma unroll
      for (int j = 0; j < kScanChunk; ++j)
        v[j] = u0 + j < num_units ? scratch[(int64_t)(u0 + j) * g.L + l] : 0;
#pragma unroll
      for (int j = 0; j < kScanChunk; ++j) {
        if (u0 + j < num_units) scratch[(int64_t)(u0 + j) * g.L + l] = running;
        running += v[j];
      }
    }
    counts[l] = running;
  }
  __syncthreads();
  // Exclusive scan of padded counts -> offsets, in chunks of blockDim experts.
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  for (int base = 0; base < g.L; base += blockDim.x) {
    int l = base + threadIdx.x;
    int32_t padded = l < g.L ? (int32_t)mok::round_up(counts[l], tile_rows) : 0;
    int32_t incl = padded;
#pragma unroll
    for (int d = 1; d < kWarp; d <<= 1) {
      int32_t n = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += n;
    }
    if (lane == kWarp - 1) warp_sums[warp] = incl;
    __syncthreads();
    int32_t before = carry;
    for (int w = 0; w < warp; ++w) before += warp_sums[w];
    if (l < g.L) offsets[l] = before + incl - padded;
    __syncthreads();
    if (threadIdx.x == blockDim.x - 1) carry = before + incl;
    __syncthreads();
  }
  if (threadIdx.x == 0) offsets[g.L] = carry;
  __syncthreads();
  // Padding rows of each segment -> (-1, -1).
  for (int l = warp; l < g.L; l += blockDim.x / kWarp) {
    int first_pad = offsets[l] + counts[l];
    int end = offsets[l + 1];
    for (int i = first_pad + lane; i < end; i += kWarp) {
      table[2 * (int64_t)i] = -1;
      table[2 * (int64_t)i + 1] = -1;
    }
  }
}

__global__ void place_kernel(const int64_t* const* ids_ptrs, const int32_t* const* ntok_ptrs,
                             Geometry g, const int32_t* scratch, const int32_t* offsets,
                             int32_t* table) {
  extern __shared__ int32_t next_row[];  // [L]: next free row of each expert for this unit
  const int unit = blockIdx.x;
  const int s = unit / g.units_per_rank;
  const int begin = (unit % g.units_per_rank) * kUnitRoutes;
  const int lane = threadIdx.x;
  // The ids first: their loads (a peer's over NVLink) then overlap the next-row loads.
  const int routes = tokens_of(ntok_ptrs, s, g.max_tokens, nullptr, g.rank) * g.K;
  const int end = min(begin + kUnitRoutes, routes);
  int64_t id[kRoutesPerLane];
  load_unit_ids(ids_ptrs[s], begin, end, id);
  for (int l = lane; l < g.L; l += kWarp)
    next_row[l] = offsets[l] + scratch[(int64_t)unit * g.L + l];
  __syncwarp();
  const int first = g.rank * g.L;
  const unsigned lanes_below = (1u << lane) - 1u;
#pragma unroll
  for (int j = 0; j < kRoutesPerLane; ++j) {
    const int r0 = begin + j * kWarp;
    if (r0 >= end) break;  // the same for every lane
    const int r = r0 + lane;
    int l = r < end ? local_expert(id[j], first, g.L, g.P * g.L, nullptr, g.rank, s, false) : -1;
    unsigned same = __match_any_sync(0xffffffffu, l);
    if (l >= 0) {
      int row = next_row[l] + __popc(same & lanes_below);
      table[2 * (int64_t)row] = s;
      table[2 * (int64_t)row + 1] = r;
    }
    __syncwarp();
    if (l >= 0 && (same & lanes_below) == 0) next_row[l] += __popc(same);
    __syncwarp();
  }
}

}  // namespace

MOK_API int64_t mok_schedule_table_rows(int P, int max_tokens, int K, int L, int tile_rows) {
  return (int64_t)P * max_tokens * K + (int64_t)L * (tile_rows - 1);
}

static int units_per_rank(int max_tokens, int K) {
  return (int)mok::ceil_div((int64_t)max_tokens * K, kUnitRoutes) > 0
             ? (int)mok::ceil_div((int64_t)max_tokens * K, kUnitRoutes)
             : 1;
}

MOK_API int64_t mok_schedule_scratch_ints(int P, int max_tokens, int K, int L) {
  return (int64_t)P * units_per_rank(max_tokens, K) * L;
}

MOK_API int mok_build_schedule(const int64_t* const* ids_ptrs, const int32_t* const* ntok_ptrs,
                               int P, int max_tokens, int K, int rank, int L, int tile_rows,
                               int32_t* table, int32_t* counts, int32_t* offsets,
                               int32_t* scratch, int32_t* status, cudaStream_t stream) {
  MOK_REQUIRE(ids_ptrs && ntok_ptrs && table && counts && offsets && scratch);
  MOK_REQUIRE(P >= 1 && max_tokens >= 0 && K >= 1 && L >= 1 && rank >= 0 && rank < P);
  MOK_REQUIRE(tile_rows >= 1);
  // The table holds int32 row indices and routes.
  MOK_REQUIRE(mok_schedule_table_rows(P, max_tokens, K, L, tile_rows) < (int64_t)INT32_MAX);
  // Per-warp shared histograms: keep them within the default 48 KB of shared memory.
  MOK_REQUIRE((int64_t)L * sizeof(int32_t) <= 48 * 1024);

  Geometry g{P, max_tokens, K, L, rank, units_per_rank(max_tokens, K)};
  const int num_units = P * g.units_per_rank;
  const size_t smem = (size_t)L * sizeof(int32_t);
  histogram_kernel<<<num_units, kWarp, smem, stream>>>(ids_ptrs, ntok_ptrs, g, scratch, status);
  MOK_RETURN_IF_LAUNCH_FAILED();
  scan_kernel<<<1, kScanThreads, 0, stream>>>(g, tile_rows, num_units, scratch, counts, offsets,
                                              table);
  MOK_RETURN_IF_LAUNCH_FAILED();
  place_kernel<<<num_units, kWarp, smem, stream>>>(ids_ptrs, ntok_ptrs, g, scratch, offsets,
                                                   table);
  MOK_RETURN_IF_LAUNCH_FAILED();
  return MOK_OK;
}
