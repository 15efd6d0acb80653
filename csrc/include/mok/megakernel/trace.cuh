// Optional timeline of the forward megakernel (MokMegakernelArgs::trace; null: off). One
// record of kTraceWords int64 per work item and one per CTA, written with %globaltimer
// readings by the thread that takes, waits for, starts and finishes the item:
//   compute item i        -> record i (pair mode: 2 i + the CTA's rank in its cluster)
//   pull of block b        -> record C + b, C = compute_records
//   CTA c (its whole run)  -> record C + comm_items + c
//   first-pull part i      -> record C + comm_items + gridDim.x + i
// Fields: take (taken from its queue), ready (its input acquired), start (the consumers begin
// its MMAs; = ready for comm items), done (its counter released), meta (kind | block << 8 |
// col << 40), cta. CTA records: take = start of the CTA, ready = its first consumer warpgroup
// ran out of tiles (fc2 halves counted as delivered), start = every combine-done flag seen,
// done = its share of the slot sum finished; meta = kind 5 | role << 8 (0 compute, 1 comm).
// Costs a few stores per item; tools/perf/megakernel_timeline.py reads it to see where the time
// goes.
#pragma once

#include <cstdint>

#include "mok/memory_order.cuh"

namespace mok {
namespace mega {

constexpr int kTraceWords = 6;
enum TraceField : int { kTrTake = 0, kTrReady = 1, kTrStart = 2, kTrDone = 3, kTrMeta = 4, kTrCta = 5 };
constexpr int kTraceCtaKind = 5;

struct Trace {
  int64_t* buf;
  int64_t capacity;  // records

  __device__ __forceinline__ bool on() const { return buf != nullptr; }
  __device__ __forceinline__ void put(int64_t record, int field, int64_t value) const {
    if (buf != nullptr && record >= 0 && record < capacity) buf[record * kTraceWords + field] = value;
  }
  __device__ __forceinline__ void stamp(int64_t record, int field) const {
    if (buf != nullptr) put(record, field, (int64_t)globaltimer_ns());
  }
  __device__ __forceinline__ void item(int64_t record, int kind, int block, int col) const {
    put(record, kTrMeta, (int64_t)kind | ((int64_t)block << 8) | ((int64_t)col << 40));
    put(record, kTrCta, blockIdx.x);
  }
};

}  // namespace mega
}  // namespace mok
