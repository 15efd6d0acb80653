// The forward megakernel's work plan (mok/megakernel/plan.cuh) on the host, for the CPU tests
// that replay the kernel's protocol and for tools that map a trace back to the layout. No CUDA
// call.
#include <cstdint>

#include "mok/cuda_check.cuh"
#include "mok/megakernel.h"
#include "mok/megakernel/plan.cuh"

using namespace mok::mega;

MOK_API int64_t mok_megakernel_counter_words(int ring_slots) {
  return ring_slots >= 1 ? counter_words(ring_slots) : 0;
}

MOK_API int mok_megakernel_plan_item(int queue, int index, int n_blocks, int mb_blocks, int slots,
                                     int n1, int n2, int pairs, int group_blocks, int32_t* out) {
  MOK_REQUIRE(out && n_blocks >= 0 && mb_blocks >= 1 && slots >= 1 && n1 >= 1 && n2 >= 1);
  MOK_REQUIRE(queue == kComputeQueue || queue == kPullQueue || queue == kFirstPullQueue);
  MOK_REQUIRE(pairs == 0 || pairs == 1);
  MOK_REQUIRE(group_blocks >= kMinGroupBlocks && group_blocks <= kMaxGroupBlocks && group_blocks % 2 == 0);
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

MOK_API int mok_megakernel_layout_blocks(const int32_t* counts, int L, int32_t* out, int64_t out_len) {
  MOK_REQUIRE(counts != nullptr && out != nullptr && L >= 1);
  int64_t n_blocks = 0;
  for (int l = 0; l < L; ++l) {
    MOK_REQUIRE(counts[l] >= 0);
    n_blocks += (counts[l] + kBlockRows - 1) / kBlockRows;
  }
  MOK_REQUIRE(n_blocks <= out_len && n_blocks < INT32_MAX);
  int first = 0;
  for (int l = 0; l < L; ++l) {
    const int n = (counts[l] + kBlockRows - 1) / kBlockRows;
    for (int b = first; b < first + n; ++b) out[b] = layout_block(first, n, b);
    first += n;
  }
  return MOK_OK;
}
