// packing_stats and dp_balance_stats on arbitrary groups (duplicated, missing or
// out-of-range indices, negative lengths, sums near int64): refused, or stats that
// are consistent with the groups.
#include "fuzz.hpp"
#include "seqpack/metrics.hpp"

using namespace seqpack;
using namespace seqpack_fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  const auto lengths = in.lengths(32, 64);
  const int64_t capacity = in.edgy(128);
  const bool balance = in.flag();
  IndexGroups groups;
  const auto n = static_cast<int64_t>(lengths.size());
  const auto num_groups = in.in_range(0, 8);
  for (int64_t g = 0; g < num_groups; ++g) {
    std::vector<int64_t> items(static_cast<size_t>(in.in_range(0, 6)));
    for (auto& i : items) i = in.flag() ? in.in_range(0, std::max<int64_t>(n - 1, 0)) : in.edgy(n);
    groups.push_group(items);
  }
  return run([&] {
    if (balance) {
      const auto s = dp_balance_stats(lengths, groups);
      require_partition(groups, lengths.size());
      FUZZ_REQUIRE(s.min <= s.max && s.minmax_diff == s.max - s.min && s.min >= 0);
    } else {
      const auto s = packing_stats(lengths, groups, capacity);
      if (groups.size() == 0) {  // NeMo-RL's calculate_stats_only: no bins, empty stats
        FUZZ_REQUIRE(s.num_bins == 0 && s.num_sequences == 0 && s.total_sequence_length == 0);
        return;
      }
      require_partition(groups, lengths.size());
      FUZZ_REQUIRE(s.num_bins == static_cast<int64_t>(groups.size()) && s.num_sequences == n);
      FUZZ_REQUIRE(s.total_sequence_length == group_sum(groups.indices, lengths));
      FUZZ_REQUIRE(s.total_sequence_length >= 0 && s.max_bin_load >= 0);
      if (s.max_bin_load <= capacity) FUZZ_REQUIRE(s.total_waste >= 0 && s.average_utilization <= 1.0 + 1e-12);
    }
  });
}
