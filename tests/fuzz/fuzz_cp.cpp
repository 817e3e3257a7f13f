// Context-parallel index maps: the ranks' local positions together hold every
// global THD position once, each rank's chunks follow the zigzag rule, and
// cp_restore_order inverts the rank-major concatenation.
#include "fuzz.hpp"
#include "seqpack/cp.hpp"

using namespace seqpack;
using namespace seqpack_fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  const int64_t cp_size = in.edgy(4);
  std::vector<int64_t> cu(static_cast<size_t>(in.in_range(0, 8)));
  int64_t at = 0;
  for (size_t i = 0; i < cu.size(); ++i) {
    // Mostly valid offsets (0, then steps that split into 2 * cp_size chunks).
    const int64_t step = cp_size > 0 && cp_size <= 4 ? 2 * cp_size * in.in_range(0, 4) : 2 * in.in_range(0, 4);
    at = i == 0 ? (in.flag() ? 0 : in.edgy(8)) : (in.flag() && at <= kMax - step ? at + step : in.edgy(64));
    cu[i] = at;
  }
  // Valid layouts of millions of positions only cost memory here; larger than int32 is refused.
  if (!cu.empty() && cu.back() > (1 << 20) && cu.back() <= std::numeric_limits<int32_t>::max()) return 0;
  return run([&] {
    const auto order = cp_restore_order(cu, cp_size);
    const int64_t total = cu.empty() ? 0 : cu.back();
    FUZZ_REQUIRE(static_cast<int64_t>(order.size()) == total);
    if (cp_size > 64) return;  // valid only for empty sequences; too many ranks to list
    std::vector<int64_t> gathered;
    for (int64_t r = 0; r < cp_size; ++r) {
      const auto local = cp_partition_indices(cu, cp_size, r);
      FUZZ_REQUIRE(static_cast<int64_t>(local.size()) * cp_size == total);
      gathered.insert(gathered.end(), local.begin(), local.end());
    }
    // gathered[order[g]] == g for every global position g.
    for (int64_t g = 0; g < total; ++g) {
      const int64_t at_gathered = order[static_cast<size_t>(g)];
      FUZZ_REQUIRE(at_gathered >= 0 && at_gathered < total && gathered[static_cast<size_t>(at_gathered)] == g);
    }
  });
}
