// plan_dynamic_batching, every rule: the sorted order is a permutation, each
// chunk's micro-batches cover its rows in order, every micro-batch is at least as
// long as its rows (clamped to max_seqlen), token counts add up.
#include "fuzz.hpp"
#include "seqpack/dynamic_batching.hpp"

using namespace seqpack;
using namespace seqpack_fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  const auto rule = static_cast<DynamicBatchingRule>(in.in_range(0, 2));
  DynamicBatchingOptions o;
  o.shards = in.edgy(4);
  o.batch_size = in.flag() ? in.edgy(16) : 0;
  o.max_tokens_per_microbatch = in.edgy(256);
  o.sequence_length_round = in.flag() ? in.edgy(8) : 1;
  o.max_seqlen = in.flag() ? in.edgy(128) : 0;
  o.pp_size = in.flag() ? in.edgy(3) : 1;
  const auto lengths = in.lengths(64, 128);
  return run([&] {
    const auto plan = plan_dynamic_batching(lengths, o, rule);
    const size_t n = lengths.size();
    FUZZ_REQUIRE(plan.sorted_indices.size() == n);
    std::vector<char> seen(n, 0);
    for (int64_t i : plan.sorted_indices) {
      FUZZ_REQUIRE(i >= 0 && static_cast<size_t>(i) < n && !seen[static_cast<size_t>(i)]++);
    }
    FUZZ_REQUIRE(plan.valid_tokens >= 0 && plan.padded_tokens >= 0);
    __int128 padded = 0;
    size_t row = 0;  // position in sorted_indices: chunk by chunk, shard by shard
    for (const auto& chunk : plan.chunks) {
      int64_t end = 0;
      for (const auto& r : chunk) {
        FUZZ_REQUIRE(r.start == end && r.end > r.start && r.length >= 0);
        end = r.end;
        padded += static_cast<__int128>(r.end - r.start) * r.length;
      }
      FUZZ_REQUIRE(end <= plan.shard_chunk_size);
      for (int64_t s = 0; s < o.shards; ++s) {
        for (const auto& r : chunk)
          for (int64_t j = r.start; j < r.end && row + static_cast<size_t>(j) < n; ++j) {
            const int64_t len = lengths[static_cast<size_t>(plan.sorted_indices[row + static_cast<size_t>(j)])];
            FUZZ_REQUIRE(r.length >= (o.max_seqlen > 0 ? std::min(len, o.max_seqlen) : len));
          }
        row += static_cast<size_t>(plan.shard_chunk_size);
      }
    }
    FUZZ_REQUIRE(padded * o.shards == plan.padded_tokens);
  });
}
