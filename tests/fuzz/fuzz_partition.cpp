// Karmarkar-Karp, greedy LPT and sorted-stride partitions: k groups holding every
// index once, equal sizes when asked, and KK's sorted variant the same sets.
#include "fuzz.hpp"
#include "seqpack/partition.hpp"

using namespace seqpack;
using namespace seqpack_fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  const auto method = in.in_range(0, 3);
  const int64_t k = in.edgy(8);
  const bool equal_size = in.flag();
  const auto values = in.lengths(48, 1000);
  return run([&] {
    IndexGroups groups;
    switch (method) {
      case 0: groups = karmarkar_karp(values, k, equal_size); break;
      case 1: groups = karmarkar_karp(values, k, equal_size, /*sort_groups=*/true); break;
      case 2: groups = greedy_lpt_partition(values, k, equal_size); break;
      default: groups = sorted_stride_partition(values, k); break;
    }
    require_partition(groups, values.size());
    FUZZ_REQUIRE(static_cast<int64_t>(groups.size()) == k);
    if (equal_size && method != 3)
      for (size_t g = 0; g < groups.size(); ++g)
        FUZZ_REQUIRE(groups.group_size(g) == static_cast<int64_t>(values.size()) / k);
  });
}
