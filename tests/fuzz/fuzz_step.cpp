// plan_step: per mini-batch, dp_size * K cells holding the mini-batch's indices
// once, no cell over the cap, K a multiple of multiple_of and at least
// min_micro_batches, the predicted time the cost of the cells and not below the
// lower bound. Costs may be NaN, infinite or negative (they must be refused).
#include <cmath>

#include "fuzz.hpp"
#include "seqpack/step.hpp"

using namespace seqpack;
using namespace seqpack_fuzz;

namespace {
double cost_value(Input& in) {
  switch (in.in_range(0, 15)) {
    case 0: return std::nan("");
    case 1: return std::numeric_limits<double>::infinity();
    case 2: return -1.0;
    case 3: return 0.0;
    default: return static_cast<double>(in.in_range(0, 1000)) / 100.0;
  }
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  StepOptions o;
  o.dp_size = in.edgy(6);
  o.max_tokens = in.edgy(256);
  o.cost.per_micro_batch = cost_value(in);
  o.cost.per_token = cost_value(in);
  o.cost.per_token_squared = in.flag() ? cost_value(in) / 100.0 : 0.0;
  o.sync = in.flag() ? StepSync::Step : StepSync::MicroBatch;
  o.mini_batches = in.flag() ? in.edgy(3) : 1;
  o.min_micro_batches = in.flag() ? in.edgy(4) : 1;
  o.multiple_of = in.flag() ? in.edgy(3) : 1;
  if (in.flag()) o.seed = in.bits(8);
  const auto lengths = in.lengths(64, 128);
  // Millions of (mostly empty) micro-batches are planned in linear but, under the
  // sanitizers, seconds of time; beyond 2^24 they are refused (checked).
  const __int128 cells = static_cast<__int128>(o.dp_size) * o.min_micro_batches;
  if (cells > (1 << 16) && cells <= (1 << 24)) return 0;
  return run([&] {
    const auto plan = plan_step(lengths, o);
    FUZZ_REQUIRE(static_cast<int64_t>(plan.mini_batches.size()) == o.mini_batches);
    int64_t expected_begin = 0;
    double total = 0.0;
    for (const auto& mb : plan.mini_batches) {
      FUZZ_REQUIRE(mb.begin == expected_begin && mb.end >= mb.begin);
      expected_begin = mb.end;
      const auto k = mb.num_micro_batches;
      FUZZ_REQUIRE(k >= o.min_micro_batches && k % o.multiple_of == 0);
      FUZZ_REQUIRE(static_cast<int64_t>(mb.cells.size()) == o.dp_size * k);
      std::vector<int64_t> local(lengths.begin() + mb.begin, lengths.begin() + mb.end);
      seqpack::IndexGroups shifted = mb.cells;
      for (auto& i : shifted.indices) i -= mb.begin;
      require_partition(shifted, local.size());
      require_under_cap(shifted, local, o.max_tokens);
      FUZZ_REQUIRE(mb.costs.size() == mb.cells.size() && mb.tokens.size() == mb.cells.size());
      const double time = step_time(mb.costs, o.dp_size, k, o.sync);
      FUZZ_REQUIRE(std::fabs(time - mb.predicted_time) <= 1e-9 * std::max(1.0, std::fabs(time)));
      FUZZ_REQUIRE(mb.lower_bound <= mb.predicted_time * (1 + 1e-9) + 1e-9);
      total += mb.predicted_time;
    }
    FUZZ_REQUIRE(expected_begin == static_cast<int64_t>(lengths.size()));
    FUZZ_REQUIRE(std::isfinite(plan.predicted_time));
  });
}
