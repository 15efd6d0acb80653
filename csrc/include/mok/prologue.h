// The forward dispatch prologue of both GPU backends in one host call: publish this rank's
// tokens, expert ids and router weights into its workspace region, meet every rank at the
// dispatch barrier, and build this rank's schedule (mok/schedule.h). One publish kernel (x,
// ids, router weights, T), then the same launches as mok_barrier and mok_build_schedule, queued
// from C: a layer's host time before its first GEMM (or the megakernel) is what a GPU with
// nothing else queued waits for.
#pragma once

#include <cuda_runtime.h>

#include "mok/common.h"

// Every field is 8 bytes wide (pointers and int64), as MokMegakernelArgs;
// mok_prologue_args_bytes() returns sizeof for a check.
typedef struct MokPrologueArgs {
  // Publish: x bf16 [T, H] -> region + rows_offset; ids int64 [T, K] -> region + ids_offset;
  // router weights fp32 [T, K] -> region + scalars_offset; T -> int32 at region + ntok_offset.
  const void* x;
  const int64_t* topk_ids;
  const float* topk_weights;
  int64_t T, H, K;
  void* region;                 // this rank's workspace region (local address)
  int64_t rows_offset, ids_offset, scalars_offset, ntok_offset;
  // Barrier (skipped when P == 1), as mok_barrier.
  const uint64_t* signal_bases;  // device [P]
  uint64_t* counter;             // this rank's barrier epoch counter
  int64_t timeout_ns, site;
  int32_t* status;               // int32 [MOK_STATUS_WORDS]
  // Schedule, as mok_build_schedule.
  const int64_t* const* ids_ptrs;   // device [P]: every rank's published ids
  const int32_t* const* ntok_ptrs;  // device [P]: every rank's published T
  int64_t P, rank, max_tokens, L, tile_rows;
  int32_t* table;    // int32 [mok_schedule_table_rows(...), 2]
  int32_t* counts;   // int32 [L]
  int32_t* offsets;  // int32 [L + 1]
  int32_t* scratch;  // int32 [mok_schedule_scratch_ints(...)]
} MokPrologueArgs;

MOK_API int64_t mok_prologue_args_bytes(void);

// Queue the prologue on `stream`. Checks every argument before queueing anything; T may be 0
// (x, topk_ids and topk_weights then null).
MOK_API int mok_dispatch_prologue(const MokPrologueArgs* args, cudaStream_t stream);
