// plan_micro_batches: every index once, no micro-batch over max_tokens, the count
// at least min_num and a multiple of multiple_of, tokens and workloads as stated.
#include "fuzz.hpp"
#include "seqpack/microbatch.hpp"

using namespace seqpack;
using namespace seqpack_fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  MicroBatchOptions o;
  o.max_tokens = in.edgy(256);
  o.min_num = in.flag() ? in.edgy(8) : 1;
  o.multiple_of = in.flag() ? in.edgy(4) : 1;
  o.attention_coeff = in.flag() ? in.edgy(64) : 0;
  o.small_at_ends = in.flag();
  const auto lengths = in.lengths(64, 128);
  return run([&] {
    const auto plan = plan_micro_batches(lengths, o);
    require_partition(plan.groups, lengths.size());
    require_under_cap(plan.groups, lengths, o.max_tokens);
    const auto count = static_cast<int64_t>(plan.groups.size());
    // No sequences, no micro-batches; otherwise the count constraints hold.
    FUZZ_REQUIRE(lengths.empty() ? count == 0 : count >= o.min_num && count % o.multiple_of == 0);
    FUZZ_REQUIRE(plan.tokens.size() == plan.groups.size() && plan.workloads.size() == plan.groups.size());
    const auto work = sequence_workloads(lengths, o.attention_coeff);
    for (size_t g = 0; g < plan.groups.size(); ++g) {
      FUZZ_REQUIRE(plan.tokens[g] == group_sum(plan.groups.group(g), lengths));
      FUZZ_REQUIRE(plan.workloads[g] == group_sum(plan.groups.group(g), work));
    }
  });
}
