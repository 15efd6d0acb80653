// The pull crews of the forward megakernel: who copies the routed rows into the ring, and when.
//
// - The first pulls (plan.cuh, the first-pull queue): every CTA, with all its threads, when the
//   launch starts (nothing can be computed before the first blocks land). A compute CTA takes
//   parts of the first group's blocks only, then starts on its tiles; a comm CTA takes every
//   part left, then joins the compute CTAs.
// - The pull helpers: warps 1-3 of every compute CTA's producer warpgroup (thread 0 issues the
//   TMA loads, the other warps are idle otherwise). Once the first group's blocks have landed
//   they take what is left of the first-pull queue, then the whole pull queue, next to the
//   CTA's tiles.
// A comm CTA holds compute items only after its last pull, and a compute item waits only for
// earlier positions' work, so joining adds no cycle of waits (tests/megakernel replays the
// protocol).
#pragma once

#include <cstdint>

#include "mok/gemm/ptx.cuh"
#include "mok/megakernel.h"
#include "mok/megakernel/kernel_params.cuh"
#include "mok/megakernel/plan.cuh"
#include "mok/megakernel/rows.cuh"
#include "mok/megakernel/sync.cuh"
#include "mok/megakernel/tiles.cuh"
#include "mok/megakernel/trace.cuh"

namespace mok {
namespace mega {

// The next position of a queue if it is below `limit` (it is then taken), else `limit`. Others
// may take positions with atomicAdd meanwhile: compare-and-swap only takes a position it saw.
__device__ __forceinline__ int take_below(int32_t* next, int limit) {
  int cur = ld_volatile(next);
  while (cur < limit) {
    const int seen = atomicCAS(next, cur, cur + 1);
    if (seen == cur) return cur;
    cur = seen;
  }
  return limit;
}

// Trace record of a comm item (trace.cuh): pulls by block, first-pull parts after the CTAs'
// records.
__device__ __forceinline__ int64_t comm_record(const Plan& plan, const Item& it, int index) {
  const int64_t base = compute_records(plan);
  if (it.kind == kPull) return base + it.block;
  return base + comm_items(plan) + gridDim.x + index;
}

// Who serves a pull queue: all threads of a CTA (barrier 0, __syncthreads), or the idle warps of
// a compute CTA's producer warpgroup (pull helpers, a named barrier of their own). The crew's
// first thread takes the items; its warps copy the rows.
struct Crew {
  int first_thread, threads, barrier;
  Item* item;  // shared memory: the item the first thread took
  __device__ __forceinline__ bool whole_cta() const { return threads == (int)blockDim.x; }
  __device__ __forceinline__ bool leads() const { return (int)threadIdx.x == first_thread; }
  __device__ __forceinline__ void sync() const {
    if (whole_cta())
      __syncthreads();
    else
      gemm::named_barrier_sync(barrier, threads);
  }
};
constexpr int kHelperBarrier = 4;  // 1 and 2: consumer warpgroups (3: free)
constexpr int kHelperFirstThread = 32;  // warps 1-3 of the producer warpgroup (thread 0 produces)
constexpr int kHelperThreads = 96;

// A crew serving a pull queue. The crew's first thread takes the next item and waits for its
// slot; the crew's warps copy the item's rows; the first thread releases the block's counter. A
// whole CTA copies with TMA bulk copies through its stage area (it has no tile in flight before
// its first), the helpers through registers (the GEMM owns the stage area). A crew takes no item
// at or past `limit` (the queue's end by default).
__device__ __forceinline__ void serve_comm_queue(const KernelParams& p, const Plan& plan, CtaShared& sh,
                                                 const int32_t* offs, uint8_t* stage_area, int queue,
                                                 const Crew& crew, int limit = INT32_MAX) {
  const Deadline d = deadline_of(p);
  const int items = queue_items(plan, queue);
  const bool bounded = limit < items;
  const int total = bounded ? limit : items;
  int32_t* next = &p.counters[queue == kPullQueue ? kPullNext : kFirstPullNext];
  const int t = (int)threadIdx.x - crew.first_thread;
  const int warp = t / 32, warps = crew.threads / 32, lane = t % 32;
  int64_t record = -1;
  const bool use_bulk = crew.whole_cta() && stage_area != nullptr;
  CopyPipe pipe{use_bulk ? stage_area + warp * kCopyWarpBytes : nullptr, &sh.copy_bars[warp * kCopyStages], 0};
  CopyPipe* bulk = use_bulk ? &pipe : nullptr;
  if (bulk != nullptr && threadIdx.x == 0) {
    for (int b = 0; b < kCopyWarps * kCopyStages; ++b) gemm::mbar_init(&sh.copy_bars[b], 1);
    gemm::mbar_fence_init();
  }
  // Also: every thread has read the item that ended the crew's previous queue (a helper crew
  // serves two in turn through one item word) before the first thread writes the next.
  crew.sync();
  for (;;) {
    if (crew.leads()) {
      Item it;
      it.kind = kEnd;
      const int i = bounded ? take_below(next, total) : atomicAdd(next, 1);
      if (i < total) {
        it = queue_item(plan, queue, i);
        record = comm_record(plan, it, i);
        p.trace.stamp(record, kTrTake);
        const Wait w = wait_of(plan, it);
        if (!wait_counter(p.counters + counter_index(w.counter, w.slot, plan.slots), w.target, d,
                          MOK_SITE_MK_PULL_WAITS_SLOT))
          it.kind = kEnd;
        if (p.trace.on()) {
          p.trace.stamp(record, kTrReady);
          p.trace.stamp(record, kTrStart);
          p.trace.item(record, it.kind, it.block, it.col);
        }
      }
      *crew.item = it;
    }
    crew.sync();  // bar.sync also extends the first thread's acquire to the crew's other threads
    const Item it = *crew.item;
    if (it.kind == kEnd) break;
    const int slot = it.block % plan.slots;
    constexpr int kPartRows = kBlockRows / kFirstPullParts;
    const RowRange range = it.kind == kPull ? kWholeBlock : RowRange{it.col * kPartRows, kPartRows};
    const int rows_block = layout_block_of(offs, expert_of_row(offs, p.L, it.block * kBlockRows), it.block);
    pull_rows(p.rows, rows_block, range, slot, warp, warps, lane, bulk);
    fence_proxy_async_global();  // fc1 reads these rows with TMA
    crew.sync();  // every row of the block written; every thread has read *crew.item
    if (crew.leads()) {
      red_release_gpu_add(p.counters + counter_index(signal_counter(it.kind), slot, plan.slots),
                          signal_amount(it.kind));
      p.trace.stamp(record, kTrDone);
    }
  }
}

// The pull helpers (warps 1-3 of a compute CTA's producer warpgroup): first what is left of the
// first-pull queue, once the first group's blocks have landed (before, their pulls would share
// NVLink with the first group's, which the first tiles wait for; after, the comm CTAs alone
// would pull the rest of the first two minibatches late), then the whole pull queue. Not
// inlined (see serve_first_pulls).
__device__ __noinline__ void help_pulls(const KernelParams& p, const Plan& plan, CtaShared& sh, const int32_t* offs) {
  const Crew crew{kHelperFirstThread, kHelperThreads, kHelperBarrier, &sh.helper_item};
  if (crew.leads()) {
    const Deadline d = deadline_of(p);
    const int group = first_pull_items_for_compute(plan) / kFirstPullParts;
    for (int b = 0; b < group; ++b)  // first blocks are their slots' first generation: slot b
      if (!wait_counter(p.counters + counter_index(kXReady, b, plan.slots), kFirstPullParts, d,
                        MOK_SITE_MK_FC1_WAITS_PULL))
        break;
  }
  serve_comm_queue(p, plan, sh, offs, nullptr, kFirstPullQueue, crew);
  serve_comm_queue(p, plan, sh, offs, nullptr, kPullQueue, crew);
}

// The first-pull queue, served by every CTA when it starts: a compute CTA takes parts of the
// first group's blocks only (its first tiles need nothing else; first_pull_items_for_compute), a
// comm CTA every part left (with the compute CTAs' helpers, help_pulls).
// Not inlined: an inlined copy of the row-copy code in the kernel made ptxas spill in the GEMM
// epilogue (168 registers, the launch bound).
__device__ __noinline__ void serve_first_pulls(const KernelParams& p, const Plan& plan, CtaShared& sh,
                                               const int32_t* offs, uint8_t* stage_area, bool compute_cta) {
  const Crew crew{0, (int)blockDim.x, 0, &sh.comm_item};
  serve_comm_queue(p, plan, sh, offs, stage_area, kFirstPullQueue, crew,
                   compute_cta ? first_pull_items_for_compute(plan) : INT32_MAX);
}

}  // namespace mega
}  // namespace mok
