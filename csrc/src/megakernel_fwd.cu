// The forward megakernel (see mok/megakernel.h and docs/megakernel.md).
//
// One persistent launch of one CTA per SM (three warpgroups, the grouped GEMMs' shared-memory
// plan). Each CTA takes a ticket when it starts: the first comm_ctas tickets become comm CTAs
// (pull row blocks, all 12 warps on one block at a time), the others compute CTAs (a TMA
// producer thread and two wgmma consumer warpgroups on fc1/fc2 tiles; fc2's epilogue pushes the
// output rows home). Roles by ticket, not by blockIdx, so whichever CTAs run first include the
// comm CTAs: the launch makes progress with any number of resident CTAs above comm_ctas. A comm
// CTA whose pull queue is empty joins the compute CTAs. Once its queue is empty every CTA joins
// the combine-done wait and the slot sum with all its threads. Every CTA that ran fc2 tiles
// counts them as delivered at its end; whoever completes the count raises the combine-done
// flags on every rank.
//
// Kernel-boundary reasoning (what this launch may read without in-kernel synchronisation):
// the schedule (table, offsets, counts) and the counter reset + epoch come from earlier
// kernels of this stream; the peers' published tokens and router weights were made visible
// by barrier 1 of this call (mok_barrier: fence.acq_rel.sys, st.release.sys / ld.acquire.sys)
// and are not rewritten by their owners before every rank's combine-done flag of this call has
// been seen; y is read by later kernels of the stream. Inside the launch every hand-over goes
// through a counter (release/acquire .gpu) or the combine-done flags (.sys); see the comments
// at each release and sync.cuh.
#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "mok/cuda_check.cuh"
#include "mok/gemm/host.cuh"
#include "mok/megakernel.h"
#include "mok/megakernel/plan.cuh"
#include "mok/megakernel/push.cuh"
#include "mok/megakernel/rows.cuh"
#include "mok/megakernel/slot_sum.cuh"
#include "mok/megakernel/sync.cuh"
#include "mok/megakernel/tiles.cuh"
#include "mok/megakernel/trace.cuh"

using namespace mok::mega;
namespace g = mok::gemm;

namespace {

struct KernelParams {
  TileOperands ops;
  RowSpaces rows;
  const uint64_t* signal_bases;
  const int64_t* ids;
  uint4* y;
  const int32_t* offsets;
  const int32_t* counts;
  int32_t* counters;
  int32_t* status;
  int64_t timeout_ns;
  Trace trace;
  int P, rank, L, T, E;
  int comm_ctas;
  int first_minibatches;  // minibatches whose blocks every CTA pulls in parts at the start
  int mb_blocks, slots, n1, n2;
  int bulk_copies;   // 1: comm CTAs move rows with TMA bulk copies; 0: through registers
  int pairs;         // 1: launched in clusters of two that run pair tiles (plan.cuh)
  int block_order;   // which layout rows a block of the queues stands for (plan.cuh, BlockOrder)
  int comm_joins;    // 1: a comm CTA whose pull queue is empty joins the compute CTAs
  int pull_helpers;  // 1: warps 1-3 of every compute CTA serve the pull queue too (Crew)
  int early_sum;     // EarlySum: warps with nothing left to do sum tokens whose rows are home early
  int late_minibatches;  // the last minibatches the early sum waits out (Plan::late_minibatches)
  int first_group;       // Plan::first_group
  int comm_pull_limit;   // pull-queue positions a comm CTA may take (the helpers take the rest)
  int relaxed_polls;     // Deadline::relaxed_polls
  int group_blocks;      // Plan::group_blocks
};

// Shared memory after the stage ring (whose plan is Fc1Cfg::kSmemBytes, alignment included).
struct CtaShared {
  uint64_t copy_bars[kCopyWarps * kCopyStages];  // comm CTAs' bulk-copy mbarriers
  StageRecord records[g::kMaxStages];
  Item comm_item;
  Item helper_item;  // pull helpers (Crew)
  SumShared sum;
  uint64_t epoch;
  uint64_t mail;        // pair mode: the producers' hand-over barrier (tiles.cuh, PairLink)
  int32_t ticket;
  int32_t n_blocks;
  int32_t pair_ticket;  // pair mode: the compute-queue position handed to the follower
  DeliveryArgs delivery;  // in shared memory: kept out of the registers of the GEMM loop
};
constexpr int kSmemBytes = Fc1Cfg::kSmemBytes + (int)sizeof(CtaShared);
static_assert(Fc1Cfg::kSmemBytes % alignof(CtaShared) == 0, "CtaShared alignment");
static_assert(kSmemBytes <= g::kSmemLimit, "shared memory budget");
static_assert(g::kThreads / 32 == kCopyWarps, "every warp of a comm CTA has a copy pipe");
static_assert(kCopyWarps * kCopyWarpBytes <= Fc1Cfg::kStages * Fc1Cfg::kStageBytes,
              "the comm CTAs' copy chunks fit the GEMM stage area");

__device__ __forceinline__ Deadline deadline_of(const KernelParams& p) {
  return Deadline{p.status, p.timeout_ns, p.rank, p.relaxed_polls};
}

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
      g::named_barrier_sync(barrier, threads);
  }
};
constexpr int kHelperBarrier = 4;  // 1 and 2: consumer warpgroups (3: free)
constexpr int kHelperFirstThread = 32;  // warps 1-3 of the producer warpgroup (thread 0 produces)
constexpr int kHelperThreads = 96;

// A crew serving a pull queue: every CTA the first-pull queue when it starts, the comm CTAs then
// the pull queue, and with pull helpers the idle warps of every compute CTA the pull queue too.
// The crew's first thread takes the next item and waits for its slot; the crew's warps copy the
// item's rows; the first thread releases the block's counter. A whole CTA copies with TMA bulk
// copies through its stage area (a compute CTA has no tile in flight before its first), helpers
// through registers (the GEMM owns the stage area). A crew takes no item at or past `limit`
// (the queue's end by default).
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
  const bool use_bulk = p.bulk_copies && crew.whole_cta() && stage_area != nullptr;
  CopyPipe pipe{use_bulk ? stage_area + warp * kCopyWarpBytes : nullptr, &sh.copy_bars[warp * kCopyStages], 0};
  CopyPipe* bulk = use_bulk ? &pipe : nullptr;
  if (bulk != nullptr && threadIdx.x == 0) {
    for (int b = 0; b < kCopyWarps * kCopyStages; ++b) g::mbar_init(&sh.copy_bars[b], 1);
    g::mbar_fence_init();
  }
  // Also: every thread has read the item that ended the crew's previous queue (a comm CTA and a
  // helper crew serve two in turn through one item word) before the first thread writes the next.
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
    const int rows_block =
        layout_block_of(offs, expert_of_row(offs, p.L, it.block * kBlockRows), it.block, p.block_order);
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

// The pull queue, served by warps 1-3 of a compute CTA's producer warpgroup (idle otherwise:
// thread 0 issues the TMA loads) next to the comm CTAs; with Plan::first_group, first what is
// left of the first-pull queue, once the first group's blocks have landed (before, their pulls
// would share NVLink with the first group's, which the first tiles wait for; after, the comm
// CTAs alone would pull the rest of the first two minibatches late). Not inlined (see
// serve_first_pulls).
__device__ __noinline__ void help_pulls(const KernelParams& p, const Plan& plan, CtaShared& sh, const int32_t* offs) {
  const Crew crew{kHelperFirstThread, kHelperThreads, kHelperBarrier, &sh.helper_item};
  if (plan.first_group) {
    if (crew.leads()) {
      const Deadline d = deadline_of(p);
      const int group = first_pull_items_for_compute(plan) / kFirstPullParts;
      for (int b = 0; b < group; ++b)  // first blocks are their slots' first generation: slot b
        if (!wait_counter(p.counters + counter_index(kXReady, b, plan.slots), kFirstPullParts, d,
                          MOK_SITE_MK_FC1_WAITS_PULL))
          break;
    }
    serve_comm_queue(p, plan, sh, offs, nullptr, kFirstPullQueue, crew);
  }
  serve_comm_queue(p, plan, sh, offs, nullptr, kPullQueue, crew);
}

// The first-pull queue, served by every CTA when it starts: a compute CTA takes parts of the
// first group's blocks only (its first tiles need nothing else; first_pull_items_for_compute), a
// comm CTA every part left (with the compute CTAs' helpers, help_pulls).
// Not inlined: a third inlined copy of the row-copy code made ptxas spill in the GEMM epilogue
// (168 registers, the launch bound).
__device__ __noinline__ void serve_first_pulls(const KernelParams& p, const Plan& plan, CtaShared& sh,
                                               const int32_t* offs, uint8_t* stage_area, bool compute_cta) {
  const Crew crew{0, (int)blockDim.x, 0, &sh.comm_item};
  serve_comm_queue(p, plan, sh, offs, stage_area, kFirstPullQueue, crew,
                   compute_cta ? first_pull_items_for_compute(plan) : INT32_MAX);
}

__global__ void __launch_bounds__(g::kThreads, 1) forward_kernel(const __grid_constant__ KernelParams p) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  // Pair mode: every stage is released by the consumers of both CTAs of the cluster (the peer
  // multicasts into it); the rings follow the launch's cluster size.
  const g::SmemRing<Fc1Cfg> ring1(smem_raw, g::kPeersOfLaunch);
  const g::SmemRing<Fc2Cfg> ring2(smem_raw, g::kPeersOfLaunch);
  CtaShared& sh = *reinterpret_cast<CtaShared*>(smem_raw + Fc1Cfg::kSmemBytes);
  const int rank = p.pairs ? (int)g::cluster_rank() : 0;
  if (threadIdx.x == 0) {
    // Roles by ticket; a cluster takes two consecutive tickets (comm_ctas is even in pair mode,
    // so both CTAs of a cluster get the same role).
    if (rank == 0) sh.ticket = atomicAdd(&p.counters[kRoleTicket], p.pairs ? 2 : 1);
    sh.epoch = *reinterpret_cast<const uint64_t*>(p.counters + kEpochLo);  // the reset kernel's
    sh.n_blocks = p.offsets[p.L] / kBlockRows;
    // The early sum (slot_sum.cuh): this rank's late experts start at the expert of its first
    // late block (the first of the last late_minibatches minibatches).
    const Plan plan{sh.n_blocks, p.mb_blocks, p.slots, p.n1, p.n2, p.first_minibatches, p.pairs, p.late_minibatches,
                    p.first_group, p.group_blocks};
    const int first_late = first_late_block(plan);
    const int64_t late_from =
        (int64_t)p.rank * p.L + (first_late < plan.n_blocks ? expert_of_row(p.offsets, p.L, first_late * kBlockRows) : p.L);
    // Without the early sum nobody reads the early flags before the combine-done flags: the
    // warpgroups count their early halves only with the rest, at the end (no system fence in the
    // middle of the launch).
    const int early_record = p.early_sum ? early_position(plan) * (p.pairs ? 2 : 1) : INT32_MAX;
    sh.delivery = DeliveryArgs{p.counters, p.status,           p.signal_bases,       sh.epoch,
                               p.P,        p.rank,             fc2_arrivals(plan),   early_arrivals(plan),
                               early_record, late_from};
    ring1.init_barriers();
    g::mbar_init(&sh.mail, 1);
    g::mbar_fence_init();
  }
  for (int i = threadIdx.x; i <= p.L; i += blockDim.x) ring1.table0[i] = p.offsets[i];
  for (int i = threadIdx.x; i < p.L; i += blockDim.x) ring1.table1[i] = p.counts[i];
  if (p.pairs) {
    g::cluster_sync();  // barriers initialised in both CTAs, the leader's ticket taken
    if (threadIdx.x == 0 && rank == 1) sh.ticket = (int32_t)g::ld_shared_cluster_u32(&sh.ticket, 0) + 1;
  }
  __syncthreads();
  const Plan plan{sh.n_blocks, p.mb_blocks, p.slots, p.n1, p.n2, p.first_minibatches, p.pairs, p.late_minibatches,
                    p.first_group, p.group_blocks};
  const int wg = threadIdx.x / 128;
  const int64_t cta_record =
      p.trace.on() ? (int64_t)compute_records(plan) + comm_items(plan) + (int64_t)blockIdx.x : (int64_t)-1;
  if (p.trace.on() && threadIdx.x == 0) {
    p.trace.stamp(cta_record, kTrTake);
    p.trace.put(cta_record, kTrMeta, kTraceCtaKind | ((sh.ticket < p.comm_ctas ? 1 : 0) << 8));
    p.trace.put(cta_record, kTrCta, blockIdx.x);
  }
  // No early block (at most late_minibatches minibatches): one CTA raises the early flags now.
  if (threadIdx.x == 0 && sh.ticket == 0 && sh.delivery.early_total == 0 && !timeout_recorded(p.status))
    raise_early_delivered(p.signal_bases, p.P, p.rank, sh.epoch, sh.delivery.late_from);
  // Every CTA pulls the first blocks, in parts, before it takes its role: nothing can be
  // computed before they land, and the comm CTAs then start on the blocks after them.
  const bool comm_cta = sh.ticket < p.comm_ctas;
  serve_first_pulls(p, plan, sh, ring1.table0, ring1.a(0), !comm_cta);
  if (comm_cta) {
    serve_comm_queue(p, plan, sh, ring1.table0, ring1.a(0), kPullQueue, Crew{0, (int)blockDim.x, 0, &sh.comm_item},
                     p.comm_pull_limit);
    if (threadIdx.x == 0) p.trace.stamp(cta_record, kTrReady);
    // No rows routed to this rank: no fc2 tile will complete the count of deliveries. (Every
    // pull happens-before the fc2 tiles of its block through the counters, so the flags also
    // say that this rank has read everything it pulls from its peers.)
    if (plan.n_blocks == 0 && sh.ticket == 0 && threadIdx.x == 0 && !timeout_recorded(p.status))
      raise_combine_done(p.signal_bases, p.P, p.rank, sh.epoch);
  }
  // A comm CTA whose pull queue is empty (every block is pulled or being pulled), or that has
  // reached comm_pull_limit (by default right after the first pulls: the compute CTAs' helpers
  // serve the pull queue), joins the compute CTAs on what is left of
  // the compute queue. It holds compute items only after its last pull, and a compute item
  // waits only for earlier positions' work, so this adds no cycle of waits.
  if (!comm_cta || p.comm_joins) {
    // Pair mode: the peer multicasts into this CTA's stages as soon as its producer starts, and
    // the pulls used them as copy chunks (their bulk stores complete): both CTAs finish those
    // first.
    if (p.pairs) g::cluster_sync();
    const ComputeContext cx{p.counters, deadline_of(p), p.L, p.trace};
    const PairLink link{p.pairs ? rank : -1, &sh.mail, &sh.pair_ticket};
    // No setmaxnreg: the consumers' code fits the launch bound's 168 registers without spills
    // in the GEMM loop or the epilogues (ptxas -v: 8 bytes, the trace record of the CTA), and at
    // 40 registers the producer's queue and wait logic would spill.
    if (wg == 0) {
      if (threadIdx.x == 0)
        produce_tiles(p.ops, plan, cx, ring1.table0, ring1.table1, ring1, ring2, sh.records, link, p.block_order);
      else if (p.pull_helpers && !comm_cta && threadIdx.x >= kHelperFirstThread)
        help_pulls(p, plan, sh, ring1.table0);
    } else {
      const Fc2Tally tally = consume_tiles(p.ops, plan, cx, ring1, ring2, sh.records, sh.delivery, wg - 1);
      deliver_fc2(sh.delivery, tally, wg - 1);
      if (threadIdx.x == 128) p.trace.stamp(cta_record, kTrReady);
    }
  }
  const SumArgs sa{p.signal_bases,
                   reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(p.rows.bases[p.rank]) +
                                                  p.ops.push.slots_offset),
                   p.ids, p.y, p.counters, deadline_of(p), sh.epoch, p.P, p.rank, p.T, p.rows.K, p.E,
                   p.rows.vecs, p.trace, cta_record, p.early_sum, p.L};
  combine_and_sum(sa, sh.sum, threadIdx.x);
  if (threadIdx.x == 0) p.trace.stamp(cta_record, kTrDone);
  // Pair mode: neither CTA exits while its peer may still arrive on its barriers.
  if (p.pairs) g::cluster_sync();
}

// Zeroes the counters (queues, arrivals, per-slot counters) and takes this call's epoch from
// the workspace's barrier counter, which mok_barrier advances the same way: every rank runs the
// same sequence of barriers and launches, so the epochs agree across ranks.
__global__ void reset_kernel(int32_t* counters, int64_t words, uint64_t* epoch_counter) {
  for (int64_t i = kComputeNext + threadIdx.x; i < words; i += blockDim.x) counters[i] = 0;
  if (threadIdx.x == 0) {
    const uint64_t epoch = *epoch_counter + 1;
    *epoch_counter = epoch;
    *reinterpret_cast<uint64_t*>(counters + kEpochLo) = epoch;
  }
}
static_assert(kEpochLo == 0 && kComputeNext == 2, "the epoch takes words 0-1, the rest is reset");

// MOK_MEGAKERNEL_COPIES=registers moves rows through registers instead of TMA bulk copies
// (for comparison; the results are bitwise the same).
bool bulk_copies_enabled() {
  const char* v = std::getenv("MOK_MEGAKERNEL_COPIES");
  return v == nullptr || std::strcmp(v, "registers") != 0;
}

// Switches kept for comparison (the results are bitwise the same either way):
// MOK_MEGAKERNEL_HALF_A=0 loads all 128 rows of A for every tile; MOK_MEGAKERNEL_PAIRS=0 / 1
// launches single CTAs / clusters of two whatever MokMegakernelArgs::pairs asks;
// MOK_MEGAKERNEL_BLOCK_ORDER=0 / 1 hands out every expert's blocks in layout / zigzag order
// (block_order_for);
// MOK_MEGAKERNEL_COMM_JOINS=0 keeps the comm CTAs off the compute queue;
// MOK_MEGAKERNEL_PULL_HELPERS=0 leaves the pull queue to the comm CTAs alone;
// MOK_MEGAKERNEL_EARLY_SUM=1 turns the early sum on (off by default), =2 (for the tests) has it
// take every unit it may, past the combine-done flags (early_sum_mode);
// MOK_MEGAKERNEL_RELAXED_POLLS=0 has every try of a wait acquire (Deadline::relaxed_polls);
// MOK_MEGAKERNEL_GROUP_BLOCKS sets the row blocks of a group (group_blocks_for).
bool env_flag(const char* name, bool fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == 0) return fallback;
  return std::strcmp(v, "0") != 0;
}

// MOK_MEGAKERNEL_FIRST_GROUP=0: compute CTAs pull parts of the whole first minibatch, not only of
// its first group (Plan::first_group), for comparison.
// MOK_MEGAKERNEL_FIRST_PULL: minibatches whose blocks every CTA pulls in parts when the launch
// starts, for comparison: unset kFirstPullMinibatches, 0 none (every pull by the comm CTAs,
// whole blocks, as before the eighth session); at most 8 (a valid ring bounds it further).
int first_minibatches_for() {
  const char* v = std::getenv("MOK_MEGAKERNEL_FIRST_PULL");
  if (v == nullptr || *v == 0) return kFirstPullMinibatches;
  const long n = std::strtol(v, nullptr, 10);
  return n < 0 ? 0 : (n > 8 ? 8 : (int)n);
}

// MOK_MEGAKERNEL_GROUP_BLOCKS: row blocks of a group (the tiles of one column sweep), for
// comparison: unset kGroupBlocks; an even number from 2 to 64 (others: kGroupBlocks). The
// results are bitwise the same (a tile's sums do not depend on when it runs).
int group_blocks_for() {
  const char* v = std::getenv("MOK_MEGAKERNEL_GROUP_BLOCKS");
  if (v == nullptr || *v == 0) return kGroupBlocks;
  const long n = std::strtol(v, nullptr, 10);
  return (n >= 2 && n <= 64 && n % 2 == 0) ? (int)n : kGroupBlocks;
}

// MOK_MEGAKERNEL_BLOCK_ORDER: which layout rows a block of the queues stands for (plan.cuh,
// BlockOrder), for comparison: unset or 1 zigzag, 0 layout order. The results are bitwise the
// same.
int block_order_for() {
  const char* v = std::getenv("MOK_MEGAKERNEL_BLOCK_ORDER");
  if (v == nullptr || *v == 0) return kZigzag;
  return std::strtol(v, nullptr, 10) <= 0 ? kLayoutOrder : kZigzag;
}

// MOK_MEGAKERNEL_EARLY_SUM: unset or 0 kNoEarlySum, 1 kEarlySum, 2 kEarlySumAll (slot_sum.cuh).
// Off by default since the twentieth session: under the 700 W cap the early reads beside the last
// tiles cost more clock than the shorter tail gives back (0.07-0.12 ms slower at 48 experts per
// GPU, 0.05-0.09 at 6, paired on two machines).
int early_sum_mode() {
  const char* v = std::getenv("MOK_MEGAKERNEL_EARLY_SUM");
  if (v == nullptr || *v == 0) return kNoEarlySum;
  const long n = std::strtol(v, nullptr, 10);
  return n <= 0 ? kNoEarlySum : (n >= 2 ? kEarlySumAll : kEarlySum);
}

// MOK_MEGAKERNEL_COMM_PULL_LIMIT: pull-queue positions the comm CTAs may take before they join
// the compute queue (the pull helpers serve all of it), for comparison; unset: none (the comm
// CTAs join the compute CTAs right after the first pulls: -0.08 to -0.11 ms per call without
// grad, nineteenth session, -0.14 to -0.25 with the training copies, twentieth).
int comm_pull_limit() {
  const char* v = std::getenv("MOK_MEGAKERNEL_COMM_PULL_LIMIT");
  if (v == nullptr || *v == 0) return 0;
  const long n = std::strtol(v, nullptr, 10);
  return n < 0 ? 0 : (n > INT32_MAX ? INT32_MAX : (int)n);
}

// MOK_MEGAKERNEL_LATE_MINIBATCHES: the last minibatches the early sum waits out, for
// comparison: unset kLateMinibatches, otherwise 1 to 8.
int late_minibatches_for() {
  const char* v = std::getenv("MOK_MEGAKERNEL_LATE_MINIBATCHES");
  if (v == nullptr || *v == 0) return kLateMinibatches;
  const long n = std::strtol(v, nullptr, 10);
  return n < 1 ? 1 : (n > 8 ? 8 : (int)n);
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

// A per-device value that costs host time to query (the shared-memory attribute and the
// occupancy queries cost more than the launch itself): `query(int*)` runs once per device and
// returns a cudaError_t; the value (>= 0) is cached as value + 1, so 0 means "not known yet".
constexpr int kMaxDevices = 64;
using DeviceCache = std::atomic<int>[kMaxDevices];

template <class Query>
cudaError_t once_per_device(DeviceCache& cache, int* out, Query query) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const bool cached = dev >= 0 && dev < kMaxDevices;
  if (cached) {
    const int known = cache[dev].load(std::memory_order_relaxed);
    if (known > 0) {
      *out = known - 1;
      return cudaSuccess;
    }
  }
  e = query(out);
  if (e != cudaSuccess) return e;
  if (cached && *out >= 0) cache[dev].store(*out + 1, std::memory_order_relaxed);
  return cudaSuccess;
}

// CTAs of forward_kernel per SM on the current device (0: it does not fit). Sets the kernel's
// shared-memory attribute, which every launch and the cluster query below need, on the first
// call for a device.
DeviceCache g_ctas_per_sm;

cudaError_t ctas_per_sm(int* out) {
  return once_per_device(g_ctas_per_sm, out, [](int* n) {
    const cudaError_t e = cudaFuncSetAttribute(forward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    return e != cudaSuccess ? e : cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, forward_kernel, g::kThreads,
                                                                                 kSmemBytes);
  });
}

// A launch of `grid` CTAs of forward_kernel in clusters of two (pair mode); `attr` holds the
// cluster attribute the configuration points to.
cudaLaunchConfig_t pair_launch_config(int64_t grid, cudaStream_t stream, cudaLaunchAttribute* attr) {
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = 2;
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)grid, 1, 1);
  cfg.blockDim = dim3(g::kThreads, 1, 1);
  cfg.dynamicSmemBytes = kSmemBytes;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

// Clusters of two CTAs of forward_kernel that can be resident at once on the current device
// (pair mode); 0 when none fits. After ctas_per_sm (the shared-memory attribute).
DeviceCache g_resident_pairs;

cudaError_t resident_pairs(int sms, int* out) {
  return once_per_device(g_resident_pairs, out, [sms](int* n) {
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = pair_launch_config(sms / 2 * 2, nullptr, &attr);
    const cudaError_t e = cudaOccupancyMaxActiveClusters(n, forward_kernel, &cfg);
    if (e == cudaSuccess && *n < 0) *n = 0;
    return e;
  });
}

// The launch's grid and whether it runs in pair mode. One CTA per SM, every CTA resident: the
// grid comes from the occupancy query, never from the work (a fixed share of the SMs when the
// caller asks for fewer). Pair mode (when wanted: MokMegakernelArgs::pairs, or
// MOK_MEGAKERNEL_PAIRS): clusters of two CTAs that run pair tiles and share the weight tile
// (plan.cuh), taken only when it keeps every CTA of that grid: an even grid and comm CTA
// count, and that many CTAs resident as clusters.
int launch_shape(int64_t comm_ctas, int64_t num_ctas, bool want_pairs, int64_t* grid_out, int* pairs_out) {
  int sms = 0, per_sm = 0;
  MOK_RETURN_IF_CUDA_ERROR(g::sm_count(&sms));
  MOK_RETURN_IF_CUDA_ERROR(ctas_per_sm(&per_sm));
  if (per_sm < 1) return MOK_ERR_UNSUPPORTED;  // the CTA does not fit an SM of this device
  int64_t grid = (int64_t)sms * per_sm;
  if (num_ctas > 0 && num_ctas < grid) grid = num_ctas;
  if (grid <= comm_ctas) return MOK_ERR_INVALID_ARGUMENT;  // no CTA left to compute
  int pairs = 0;
  if (want_pairs && grid % 2 == 0 && comm_ctas % 2 == 0) {
    MOK_RETURN_IF_CUDA_ERROR(resident_pairs(sms, &pairs));
    pairs = 2 * (int64_t)pairs >= grid ? 1 : 0;
  }
  *grid_out = grid;
  *pairs_out = pairs;
  return MOK_OK;
}

// Argument checks (no CUDA call). Returns MOK_OK or MOK_ERR_INVALID_ARGUMENT.
int check_args(const MokMegakernelArgs& a) {
  MOK_REQUIRE(a.bases && a.signal_bases && a.table && a.offsets && a.counts && a.fc1_weight &&
              a.fc2_weight && a.ring_x && a.ring_h && a.ring_w && a.counters && a.epoch_counter &&
              a.status);
  MOK_REQUIRE(a.T >= 0 && a.T < INT32_MAX && (a.T == 0 || (a.topk_ids && a.y)));
  MOK_REQUIRE(a.P >= 1 && a.P <= 1024 && a.rank >= 0 && a.rank < a.P);
  MOK_REQUIRE(a.L >= 1 && a.L <= g::kMaxExperts && a.K >= 1 && a.K <= kSumMaxK);
  MOK_REQUIRE(a.H > 0 && a.H % kFc2Cols == 0 && a.I > 0 && a.I % kFc1Cols == 0);
  MOK_REQUIRE(a.H <= (1 << 20) && a.I <= (1 << 20));
  MOK_REQUIRE(a.minibatch_rows > 0 && a.minibatch_rows % kBlockRows == 0);
  MOK_REQUIRE(a.ring_rows % a.minibatch_rows == 0 && a.ring_rows >= 2 * a.minibatch_rows);
  MOK_REQUIRE(a.ring_rows <= (1 << 24));
  MOK_REQUIRE(a.comm_ctas >= 2 && a.num_ctas >= 0 && a.timeout_ns > 0);
  MOK_REQUIRE(a.num_ctas == 0 || a.num_ctas > a.comm_ctas);
  MOK_REQUIRE(a.rows_offset >= 0 && a.scalars_offset >= 0 && a.slots_offset >= 0);
  MOK_REQUIRE(a.rows_offset % 16 == 0 && a.slots_offset % 16 == 0 && a.scalars_offset % 4 == 0);
  MOK_REQUIRE(aligned16(a.ring_x) && aligned16(a.ring_h) && aligned16(a.fc1_weight) &&
              aligned16(a.fc2_weight) && (a.y == nullptr || aligned16(a.y)));
  MOK_REQUIRE((reinterpret_cast<uintptr_t>(a.counters) & 7u) == 0);
  MOK_REQUIRE((reinterpret_cast<uintptr_t>(a.table) & 7u) == 0);  // fc2's epilogue reads int2 entries
  MOK_REQUIRE(a.trace == nullptr || a.trace_capacity > 0);
  const bool any_save = a.save_x || a.save_w || a.save_gu;
  MOK_REQUIRE(!any_save || (a.save_x && a.save_w && a.save_gu));
  MOK_REQUIRE(!any_save || (aligned16(a.save_x) && aligned16(a.save_gu)));
  MOK_REQUIRE((a.fc1_weight2 == nullptr) == (a.fc2_weight2 == nullptr));
  MOK_REQUIRE(a.fc1_weight2 == nullptr ? a.L1 == a.L : (a.L1 >= 1 && a.L1 < a.L));
  MOK_REQUIRE(a.fc1_weight2 == nullptr || (aligned16(a.fc1_weight2) && aligned16(a.fc2_weight2)));
  MOK_REQUIRE(a.pairs == 0 || a.pairs == 1);
  return MOK_OK;
}

}  // namespace

MOK_API int64_t mok_megakernel_args_bytes(void) { return (int64_t)sizeof(MokMegakernelArgs); }

MOK_API int64_t mok_megakernel_counter_words(int ring_slots) {
  return ring_slots >= 1 ? counter_words(ring_slots) : 0;
}

MOK_API int mok_megakernel_plan_item(int queue, int index, int n_blocks, int mb_blocks, int slots,
                                     int n1, int n2, int pairs, int group_blocks, int32_t* out) {
  MOK_REQUIRE(out && n_blocks >= 0 && mb_blocks >= 1 && slots >= 1 && n1 >= 1 && n2 >= 1);
  MOK_REQUIRE(queue == kComputeQueue || queue == kPullQueue || queue == kFirstPullQueue);
  MOK_REQUIRE(pairs == 0 || pairs == 1);
  MOK_REQUIRE(group_blocks >= 2 && group_blocks <= 64 && group_blocks % 2 == 0);
  Plan plan{n_blocks, mb_blocks, slots, n1, n2};
  plan.pairs = pairs;
  plan.group_blocks = group_blocks;
  MOK_REQUIRE(index >= 0 && index < queue_items(plan, queue));
  const Item it = queue_item(plan, queue, index);
  const Wait w = wait_of(plan, it);
  out[0] = it.kind;
  out[1] = it.block;
  out[2] = it.col;
  out[3] = w.counter;
  out[4] = w.slot;
  out[5] = w.target;
  return MOK_OK;
}

MOK_API int mok_megakernel_early_plan(int n_blocks, int mb_blocks, int n1, int n2, int pairs, int late_minibatches,
                                      int32_t* out) {
  MOK_REQUIRE(out && n_blocks >= 0 && mb_blocks >= 1 && n1 >= 1 && n2 >= 1 && late_minibatches >= 1);
  MOK_REQUIRE(pairs == 0 || pairs == 1);
  Plan plan{n_blocks, mb_blocks, 2 * mb_blocks, n1, n2};
  plan.pairs = pairs;
  plan.late_minibatches = late_minibatches;
  out[0] = first_late_block(plan);
  out[1] = early_position(plan);
  out[2] = early_arrivals(plan);
  return MOK_OK;
}

MOK_API int mok_megakernel_layout_blocks(const int32_t* counts, int L, int order, int32_t* out, int64_t out_len) {
  MOK_REQUIRE(counts != nullptr && out != nullptr && L >= 1 && order >= -1 && order <= 1);
  int64_t n_blocks = 0;
  for (int l = 0; l < L; ++l) {
    MOK_REQUIRE(counts[l] >= 0);
    n_blocks += (counts[l] + kBlockRows - 1) / kBlockRows;
  }
  MOK_REQUIRE(n_blocks <= out_len && n_blocks < INT32_MAX);
  const int resolved = order < 0 ? block_order_for() : order;
  int first = 0;
  for (int l = 0; l < L; ++l) {
    const int n = (counts[l] + kBlockRows - 1) / kBlockRows;
    for (int b = first; b < first + n; ++b) out[b] = layout_block(first, n, b, resolved);
    first += n;
  }
  return MOK_OK;
}

MOK_API int mok_megakernel_launch_shape(int64_t comm_ctas, int64_t num_ctas, int64_t want_pairs, int64_t* out) {
  MOK_REQUIRE(out != nullptr && comm_ctas >= 2 && num_ctas >= 0 && (want_pairs == 0 || want_pairs == 1));
  int64_t grid = 0;
  int pairs = 0;
  const int rc = launch_shape(comm_ctas, num_ctas, env_flag("MOK_MEGAKERNEL_PAIRS", want_pairs != 0), &grid, &pairs);
  if (rc != MOK_OK) return rc;
  out[0] = grid;
  out[1] = pairs;
  return MOK_OK;
}

MOK_API int mok_megakernel_forward(const MokMegakernelArgs* args, cudaStream_t stream) {
  MOK_REQUIRE(args != nullptr);
  const MokMegakernelArgs& a = *args;
  const int rc_args = check_args(a);
  if (rc_args != MOK_OK) return rc_args;

  const int slots = (int)(a.ring_rows / kBlockRows);
  KernelParams p{};
  int rc = g::encode_map_2d(&p.ops.fc1.map_a, a.ring_x, a.H, a.ring_rows, g::kBK, kBlockRows);
  if (rc == MOK_OK)
    rc = g::encode_map_2d(&p.ops.fc1.map_b, a.fc1_weight, a.H, a.L1 * 2 * a.I, g::kBK, g::b_box_rows<Fc1Boxes>());
  if (rc == MOK_OK) rc = g::encode_map_2d(&p.ops.fc2.map_a, a.ring_h, a.I, a.ring_rows, g::kBK, kBlockRows);
  if (rc == MOK_OK)
    rc = g::encode_map_2d(&p.ops.fc2.map_b, a.fc2_weight, a.I, a.L1 * a.H, g::kBK, g::b_box_rows<Fc2Boxes>());
  p.ops.fc1_2 = p.ops.fc1;  // A is shared (sizes set below); B is the second segment's, if any
  p.ops.fc2_2 = p.ops.fc2;
  if (rc == MOK_OK && a.fc1_weight2 != nullptr)
    rc = g::encode_map_2d(&p.ops.fc1_2.map_b, a.fc1_weight2, a.H, (a.L - a.L1) * 2 * a.I, g::kBK,
                          g::b_box_rows<Fc1Boxes>());
  if (rc == MOK_OK && a.fc2_weight2 != nullptr)
    rc = g::encode_map_2d(&p.ops.fc2_2.map_b, a.fc2_weight2, a.I, (a.L - a.L1) * a.H, g::kBK,
                          g::b_box_rows<Fc2Boxes>());
  p.ops.L1 = (int)a.L1;
  if (rc == MOK_OK) rc = g::encode_map_2d(&p.ops.fc1_a_half, a.ring_x, a.H, a.ring_rows, g::kBK, kBlockRows / 2);
  if (rc == MOK_OK) rc = g::encode_map_2d(&p.ops.fc2_a_half, a.ring_h, a.I, a.ring_rows, g::kBK, kBlockRows / 2);
  if (rc != MOK_OK) return rc;
  p.ops.half_a = env_flag("MOK_MEGAKERNEL_HALF_A", true) ? 1 : 0;
  p.ops.fc1.K = (int)a.H;
  p.ops.fc1.N = (int)(2 * a.I);
  p.ops.fc2.K = (int)a.I;
  p.ops.fc2.N = (int)a.H;
  p.ops.fc1_2.K = p.ops.fc1.K;
  p.ops.fc1_2.N = p.ops.fc1.N;
  p.ops.fc2_2.K = p.ops.fc2.K;
  p.ops.fc2_2.N = p.ops.fc2.N;
  p.ops.swiglu = {static_cast<__nv_bfloat16*>(a.ring_h), nullptr, a.ring_w, (int)a.I, a.ring_rows};
  p.ops.save_gu = static_cast<__nv_bfloat16*>(a.save_gu);
  p.ops.push = PushTargets{a.bases, a.slots_offset, a.table, (int)a.H};
  p.rows = RowSpaces{a.bases, a.rows_offset, a.scalars_offset, a.table,
                     static_cast<uint4*>(a.ring_x), a.ring_w, static_cast<uint4*>(a.save_x), a.save_w,
                     (int)a.K, (int)(a.H / 8)};
  p.signal_bases = a.signal_bases;
  p.ids = a.topk_ids;
  p.y = static_cast<uint4*>(a.y);
  p.offsets = a.offsets;
  p.counts = a.counts;
  p.counters = a.counters;
  p.status = a.status;
  p.timeout_ns = a.timeout_ns;
  p.trace = Trace{a.trace, a.trace ? a.trace_capacity : 0};
  p.P = (int)a.P;
  p.rank = (int)a.rank;
  p.L = (int)a.L;
  p.T = (int)a.T;
  p.E = (int)(a.P * a.L);
  p.comm_ctas = (int)a.comm_ctas;
  p.first_minibatches = first_minibatches_for();
  p.first_group = env_flag("MOK_MEGAKERNEL_FIRST_GROUP", true) ? 1 : 0;
  p.mb_blocks = (int)(a.minibatch_rows / kBlockRows);
  p.slots = slots;
  p.n1 = (int)(a.I / kFc1Cols);
  p.n2 = (int)(a.H / kFc2Cols);
  p.bulk_copies = bulk_copies_enabled() ? 1 : 0;
  p.block_order = block_order_for();
  p.comm_joins = env_flag("MOK_MEGAKERNEL_COMM_JOINS", true) ? 1 : 0;
  p.pull_helpers = env_flag("MOK_MEGAKERNEL_PULL_HELPERS", true) ? 1 : 0;
  // Without the helpers nobody else serves the pull queue: the comm CTAs take all of it (and
  // with comm CTAs that never join the compute CTAs, a limit would only idle them).
  p.comm_pull_limit = p.pull_helpers && p.comm_joins ? comm_pull_limit() : INT32_MAX;
  p.early_sum = a.K <= kEarlyMaxTopk && a.P <= kEarlyMaxRanks ? early_sum_mode() : 0;
  p.late_minibatches = late_minibatches_for();
  p.relaxed_polls = env_flag("MOK_MEGAKERNEL_RELAXED_POLLS", true) ? 1 : 0;
  p.group_blocks = group_blocks_for();
  const bool want_pairs = env_flag("MOK_MEGAKERNEL_PAIRS", a.pairs != 0);

  int64_t grid = 0;
  int pairs = 0;
  const int rc_shape = launch_shape(a.comm_ctas, a.num_ctas, want_pairs, &grid, &pairs);
  if (rc_shape != MOK_OK) return rc_shape;
  p.pairs = pairs;

  reset_kernel<<<1, 256, 0, stream>>>(a.counters, counter_words(slots), a.epoch_counter);
  MOK_RETURN_IF_LAUNCH_FAILED();
  if (pairs) {
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = pair_launch_config(grid, stream, &attr);
    MOK_RETURN_IF_CUDA_ERROR(cudaLaunchKernelEx(&cfg, forward_kernel, p));
  } else {
    forward_kernel<<<(unsigned)grid, g::kThreads, kSmemBytes, stream>>>(p);
  }
  MOK_RETURN_IF_LAUNCH_FAILED();
  return MOK_OK;
}
