// The schedule table: which (source rank, token, top-k slot) each local expert receives.
//
// For the expert owner `rank` of an EP group of P ranks, with L = E / P local experts:
//   counts[l]        routes to local expert l (from every rank),
//   offsets[l]       first row of expert l's segment, segments padded to `tile_rows`,
//   offsets[L]       R_pad, the padded row count,
//   table[i] = (s, t * K + j) for row i holding token t, slot j of source rank s, in the
//                    order (s, t, j) within each segment; padding rows are (-1, -1).
// Built without sorting in three launches (per-warp histograms, one scan, per-warp
// placement); no host synchronisation. Capacity of `table` (in rows):
//   mok_schedule_table_rows(P, max_tokens, K, L, tile_rows) = P*max_tokens*K + L*(tile_rows-1)
// which no routing can exceed.
#pragma once

#include <cuda_runtime.h>

#include "mok/common.h"

// Rows of the worst-case table.
MOK_API int64_t mok_schedule_table_rows(int P, int max_tokens, int K, int L, int tile_rows);
// int32 elements of scratch memory the builder needs.
MOK_API int64_t mok_schedule_scratch_ints(int P, int max_tokens, int K, int L);

// ids_ptrs:   device array of P pointers; ids_ptrs[s] -> int64 [T_s, K] ids of rank s
//             (may point into peer memory).
// ntok_ptrs:  device array of P pointers; *ntok_ptrs[s] is T_s (int32), read on the device.
// max_tokens: capacity per rank; a T_s above it is recorded as MOK_STATUS_TOO_MANY_TOKENS
//             in `status` (the value, and s in MOK_STATUS_SOURCE) and clamped.
// num_experts E = P * L; an id outside [-1, E) is recorded as MOK_STATUS_BAD_EXPERT_ID (the id,
//             saturated to int32, and its source rank s in MOK_STATUS_SOURCE) and ignored. Every
//             rank's schedule reads every rank's ids, so every rank of the group records it.
// table:      int32 [mok_schedule_table_rows(...), 2]; counts: int32 [L];
// offsets:    int32 [L + 1]; scratch: int32 [mok_schedule_scratch_ints(...)];
// status:     int32 [MOK_STATUS_WORDS] (device-accessible, may be pinned host memory) or null.
MOK_API int mok_build_schedule(const int64_t* const* ids_ptrs, const int32_t* const* ntok_ptrs,
                               int P, int max_tokens, int K, int rank, int L, int tile_rows,
                               int32_t* table, int32_t* counts, int32_t* offsets,
                               int32_t* scratch, int32_t* status, cudaStream_t stream);
