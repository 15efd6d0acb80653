// Communication kernels of the cuda backend: pull rows out of peers' memory into the
// expert-grouped layout, push rows back into peers' per-(token, slot) buffers, the
// fixed-order slot sum, and a cross-rank barrier with a timeout.
//
// Peer memory is described by `bases`: a device array of P addresses, bases[s] = the start
// of rank s's copy of a symmetric buffer (for P = 1 or P virtual ranks on one GPU these are
// plain device allocations). Row counts come from the schedule (mok/schedule.h): every
// kernel reads R_pad = offsets[L] on the device, so no host synchronisation is needed.
#pragma once

#include <cuda_runtime.h>

#include "mok/common.h"

// Pull. For each row i < offsets[L] with table[i] = (s, route):
//   rows_out[i, :H] = src[s][(per_token ? route / K : route), :H]      (bf16)
//   scalars_out[i]  = scalar_src[s][route]                              (fp32, if both set)
// Padding rows (s < 0) get zeros. src[s] = bases[s] + src_offset bytes, row stride H.
MOK_API int mok_pull_rows(const uint64_t* bases, int64_t src_offset, int per_token,
                          int64_t scalar_offset, const int32_t* table, const int32_t* offsets,
                          int L, int K, int H, void* rows_out, float* scalars_out,
                          int num_blocks, cudaStream_t stream);

// Push. For each row i < offsets[L] with table[i] = (s, route), s >= 0:
//   dst[s][route, :H] = rows[i, :H]            (bf16; dst[s] = bases[s] + dst_offset)
//   scalar_dst[s][route] = scalars[i]          (fp32, if scalars is set)
MOK_API int mok_push_rows(const uint64_t* bases, int64_t dst_offset, int64_t scalar_offset,
                          const int32_t* table, const int32_t* offsets, int L, int K, int H,
                          const void* rows, const float* scalars, int num_blocks,
                          cudaStream_t stream);

// Fixed-order slot sum on the home rank: for t < T,
//   out[t, :] = sum_{j = 0..K-1, 0 <= ids[t, j] < E} slots[t, j, :]   (fp32 sum, bf16 out)
//   scalars_out[t, j] = (0 <= ids[t, j] < E) ? scalar_slots[t, j] : 0  (if scalars_out set)
// If any flag is set in `status`, the outputs are filled with NaN instead: a failed
// exchange never yields plausible numbers.
MOK_API int mok_sum_slots(const void* slots, const int64_t* ids, int T, int K, int H, int E,
                          void* out, const float* scalar_slots, float* scalars_out,
                          const int32_t* status, cudaStream_t stream);

// Barrier across the P ranks whose signal arrays are signal_bases[s] (uint64 [2P] each: the
// flags [P], then the failure words [P], mok/common.h). Each call takes the next epoch from
// *counter (device memory, only ever incremented, so CUDA graph replays stay in step), stores
// it with release semantics (system scope) into every peer's flag for this rank, and waits with
// acquire loads until every peer's flag in this rank's array reaches the epoch. A peer that does
// not arrive within timeout_ns is recorded in `status` (MOK_STATUS_TIMEOUT, its rank, `site`),
// and this rank's failure word is set in every peer's array (MOK_FAILURE_TIMEOUT), so that they
// stop at their next barrier instead of waiting out their own timeout. A peer whose failure
// word is set is recorded as MOK_STATUS_PEER_FAILED | MOK_STATUS_TIMEOUT (its rank, the failure
// code, `site`). Once either is recorded, later barriers return at once.
MOK_API int mok_barrier(const uint64_t* signal_bases, int rank, int P, uint64_t* counter,
                        int64_t timeout_ns, int site, int32_t* status, cudaStream_t stream);

// A rank that stops before it queues a call (its own checks failed, or it learned on the host
// that a peer did) tells its peers through the device: it stores
// MOK_FAILURE_WORD(code, failed_rank) into its failure word in every peer's signal array (their
// next barrier records MOK_STATUS_PEER_FAILED, their outputs are NaN and their next call
// raises, naming failed_rank), and records MOK_STATUS_PEER_FAILED | MOK_STATUS_TIMEOUT in its
// own status word (its workspace is out of step with its peers' from then on). No waiting.
MOK_API int mok_signal_failure(const uint64_t* signal_bases, int rank, int P, int code,
                               int failed_rank, int32_t* status, cudaStream_t stream);
