// The device side of the forward megakernel (see mok/megakernel.h and docs/megakernel.md): the
// persistent kernel and the small kernel that resets its counters before it. Included by the
// host launch (src/megakernel_launch.cu) only.
//
// One persistent launch of one CTA per SM (three warpgroups, the grouped GEMMs' shared-memory
// plan). Each CTA takes a ticket when it starts: the first comm_ctas tickets become comm CTAs,
// the others compute CTAs. Roles by ticket, not by blockIdx, so whichever CTAs run first include
// the comm CTAs: the launch makes progress with any number of resident CTAs above comm_ctas.
// Every CTA first pulls parts of the first blocks with all of its threads (crews.cuh): a compute
// CTA those of the first group, a comm CTA every part left. Then every CTA computes: a TMA
// producer thread and two wgmma consumer warpgroups on fc1/fc2 tiles (tiles.cuh), fc2's
// epilogue pushing the output rows home (push.cuh); in a compute CTA, warps 1-3 of the producer
// warpgroup serve the pull queue meanwhile (the pull helpers). Once the compute queue is empty
// every CTA joins the combine-done wait and the slot sum with all its threads (slot_sum.cuh).
// Every CTA that ran fc2 tiles counts them as delivered at its end; whoever completes the count
// raises the combine-done flags on every rank.
//
// Kernel-boundary reasoning (what this launch may read without in-kernel synchronisation):
// the schedule (table, offsets, counts) and the counter reset + epoch come from earlier
// kernels of this stream; the peers' published tokens and router weights were made visible
// by barrier 1 of this call (mok_barrier: fence.acq_rel.sys, st.release.sys / ld.acquire.sys)
// and are not rewritten by their owners before every rank's combine-done flag of this call has
// been seen; y is read by later kernels of the stream. Inside the launch every hand-over goes
// through a counter (release/acquire .gpu) or the combine-done flags (.sys); see the comments
// at each release and mok/memory_order.cuh.
#pragma once

#include <cstdint>

#include "mok/gemm/config.cuh"
#include "mok/gemm/pipeline.cuh"
#include "mok/gemm/ptx.cuh"
#include "mok/megakernel/crews.cuh"
#include "mok/megakernel/kernel_params.cuh"
#include "mok/megakernel/plan.cuh"
#include "mok/megakernel/push.cuh"
#include "mok/megakernel/slot_sum.cuh"
#include "mok/megakernel/sync.cuh"
#include "mok/megakernel/tiles.cuh"
#include "mok/megakernel/trace.cuh"

namespace mok {
namespace mega {

__global__ void __launch_bounds__(gemm::kThreads, 1) forward_kernel(const __grid_constant__ KernelParams p) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  // Pair mode: every stage is released by the consumers of both CTAs of the cluster (the peer
  // multicasts into it); the rings follow the launch's cluster size.
  const gemm::SmemRing<Fc1Cfg> ring1(smem_raw, gemm::kPeersOfLaunch);
  const gemm::SmemRing<Fc2Cfg> ring2(smem_raw, gemm::kPeersOfLaunch);
  CtaShared& sh = *reinterpret_cast<CtaShared*>(smem_raw + Fc1Cfg::kSmemBytes);
  const int rank = p.pairs ? (int)gemm::cluster_rank() : 0;
  if (threadIdx.x == 0) {
    // Roles by ticket; a cluster takes two consecutive tickets (comm_ctas is even in pair mode,
    // so both CTAs of a cluster get the same role).
    if (rank == 0) sh.ticket = atomicAdd(&p.counters[kRoleTicket], p.pairs ? 2 : 1);
    sh.epoch = *reinterpret_cast<const uint64_t*>(p.counters + kEpochLo);  // the reset kernel's
    sh.n_blocks = p.offsets[p.L] / kBlockRows;
    const Plan plan{sh.n_blocks, p.mb_blocks, p.slots, p.n1, p.n2, p.pairs, p.group_blocks};
    sh.delivery = DeliveryArgs{p.counters, p.status, p.signal_bases, sh.epoch, p.P, p.rank, fc2_arrivals(plan)};
    ring1.init_barriers();
    gemm::mbar_init(&sh.mail, 1);
    gemm::mbar_fence_init();
  }
  for (int i = threadIdx.x; i <= p.L; i += blockDim.x) ring1.table0[i] = p.offsets[i];
  for (int i = threadIdx.x; i < p.L; i += blockDim.x) ring1.table1[i] = p.counts[i];
  if (p.pairs) {
    gemm::cluster_sync();  // barriers initialised in both CTAs, the leader's ticket taken
    if (threadIdx.x == 0 && rank == 1) sh.ticket = (int32_t)gemm::ld_shared_cluster_u32(&sh.ticket, 0) + 1;
  }
  __syncthreads();
  const Plan plan{sh.n_blocks, p.mb_blocks, p.slots, p.n1, p.n2, p.pairs, p.group_blocks};
  const int wg = threadIdx.x / 128;
  const int64_t cta_record =
      p.trace.on() ? (int64_t)compute_records(plan) + comm_items(plan) + (int64_t)blockIdx.x : (int64_t)-1;
  if (p.trace.on() && threadIdx.x == 0) {
    p.trace.stamp(cta_record, kTrTake);
    p.trace.put(cta_record, kTrMeta, kTraceCtaKind | ((sh.ticket < p.comm_ctas ? 1 : 0) << 8));
    p.trace.put(cta_record, kTrCta, blockIdx.x);
  }
  // Every CTA pulls the first blocks, in parts, before it computes: nothing can be computed
  // before they land.
  const bool comm_cta = sh.ticket < p.comm_ctas;
  serve_first_pulls(p, plan, sh, ring1.table0, ring1.a(0), !comm_cta);
  // No rows routed to this rank: no fc2 tile will complete the count of deliveries, so the first
  // comm CTA raises the flags. (Every pull happens-before the fc2 tiles of its block through the
  // counters, so the flags also say that this rank has read everything it pulls from its peers.)
  if (comm_cta && plan.n_blocks == 0 && sh.ticket == 0 && threadIdx.x == 0 && !timeout_recorded(p.status))
    raise_combine_done(p.signal_bases, p.P, p.rank, sh.epoch);
  // Every CTA, comm CTAs included once their first pulls are done, runs what is left of the
  // compute queue (crews.cuh says why joining adds no cycle of waits).
  // Pair mode: the peer multicasts into this CTA's stages as soon as its producer starts, and
  // the pulls used them as copy chunks (their bulk stores complete): both CTAs finish those
  // first.
  if (p.pairs) gemm::cluster_sync();
  const ComputeContext cx{p.counters, deadline_of(p), p.L, p.trace};
  const PairLink link{p.pairs ? rank : -1, &sh.mail, &sh.pair_ticket};
  // No setmaxnreg: the consumers' code fits the launch bound's 168 registers without spills
  // in the GEMM loop or the epilogues, and at 40 registers the producer's queue and wait logic
  // would spill.
  if (wg == 0) {
    if (threadIdx.x == 0)
      produce_tiles(p.ops, plan, cx, ring1.table0, ring1.table1, ring1, ring2, sh.records, link);
    else if (!comm_cta && threadIdx.x >= kHelperFirstThread)
      help_pulls(p, plan, sh, ring1.table0);
  } else {
    const Fc2Tally tally = consume_tiles(p.ops, plan, cx, ring1, ring2, sh.records, wg - 1);
    deliver_fc2(sh.delivery, tally, wg - 1);
    if (threadIdx.x == 128) p.trace.stamp(cta_record, kTrReady);
  }
  const SumArgs sa{p.signal_bases,
                   reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(p.rows.bases[p.rank]) +
                                                  p.ops.push.slots_offset),
                   p.ids, p.y, p.counters, deadline_of(p), sh.epoch, p.P, p.rank, p.T, p.rows.K, p.E,
                   p.rows.vecs, p.trace, cta_record};
  combine_and_sum(sa, sh.sum, threadIdx.x);
  if (threadIdx.x == 0) p.trace.stamp(cta_record, kTrDone);
  // Pair mode: neither CTA exits while its peer may still arrive on its barriers.
  if (p.pairs) gemm::cluster_sync();
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

}  // namespace mega
}  // namespace mok
