// Every bin packer through seqpack::pack, with the bin-count adjustment: every
// index once, no bin over capacity, the count constraints met, the same bins twice.
#include "fuzz.hpp"
#include "seqpack/packing.hpp"

using namespace seqpack;
using namespace seqpack_fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  const auto algorithms = all_algorithms();
  const auto algorithm = algorithms[static_cast<size_t>(in.in_range(0, static_cast<int64_t>(algorithms.size()) - 1))];
  PackOptions o;
  o.bin_capacity = in.edgy(64);
  o.min_bin_count = in.flag() ? in.edgy(16) : 0;
  o.bin_count_multiple = in.flag() ? in.edgy(4) : 1;
  o.seed = in.bits(8);
  o.max_sequences_per_bin = in.flag() ? in.edgy(4) : -1;
  const auto lengths = in.lengths(48, 64);
  return run([&] {
    const auto bins = pack(algorithm, lengths, o);
    require_partition(bins, lengths.size());
    require_under_cap(bins, lengths, o.bin_capacity);
    const auto count = static_cast<int64_t>(bins.size());
    FUZZ_REQUIRE(count >= o.min_bin_count && count % o.bin_count_multiple == 0);
    if (o.max_sequences_per_bin > 0 &&
        (algorithm == PackingAlgorithm::Concatenative || algorithm == PackingAlgorithm::GreedySequential) &&
        o.min_bin_count == 0 && o.bin_count_multiple == 1)
      for (size_t b = 0; b < bins.size(); ++b) FUZZ_REQUIRE(bins.group_size(b) <= o.max_sequences_per_bin);
    FUZZ_REQUIRE(pack(algorithm, lengths, o) == bins);
  });
}
