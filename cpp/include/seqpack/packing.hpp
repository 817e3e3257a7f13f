#pragma once
// Bin packing of sequence lengths into bins of a fixed token capacity.
//
// Every packer returns bins of input indices (IndexGroups). Guarantees: each index
// appears in exactly one bin, no bin holds more than `bin_capacity` tokens, no bin
// is empty, and the result is a pure function of the input (and the seed).
//
// NeMo-RL compatibility: concatenative, first_fit_decreasing and
// modified_first_fit_decreasing return exactly the bins of NeMo-RL v0.6
// (nemo_rl/data/packing/algorithms.py), bin order and item order included, with
// its tie-breaks: FFD processes items by (length, index) descending; MFFD sorts
// its classes stably and ends with the least-filled-bin leftover phase. The one
// deliberate difference: MFFD never returns the empty bin that the v0.6 leftover
// phase appends when there are no leftovers (later NeMo-RL drops it too).
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "seqpack/common.hpp"

namespace seqpack {

enum class PackingAlgorithm {
  Concatenative,
  FirstFitDecreasing,
  FirstFitShuffle,
  ModifiedFirstFitDecreasing,
  BestFitDecreasing,
  GreedySequential,
};

// Canonical lower-case name, e.g. "first_fit_decreasing".
const char* algorithm_name(PackingAlgorithm algorithm);
// Case-insensitive; throws std::invalid_argument listing the valid names.
PackingAlgorithm parse_algorithm(std::string_view name);
std::vector<PackingAlgorithm> all_algorithms();

struct PackOptions {
  int64_t bin_capacity = 0;
  int64_t min_bin_count = 0;       // 0: no minimum
  int64_t bin_count_multiple = 1;  // 1: no constraint
  uint64_t seed = 0;               // first_fit_shuffle only
  int64_t max_sequences_per_bin = -1;  // concatenative / greedy_sequential; -1: no limit
};

// Runs the algorithm, then applies the bin-count constraints (adjust_bin_count).
IndexGroups pack(PackingAlgorithm algorithm, Lengths lengths, const PackOptions& options);

// In dataset order; a sequence that does not fit closes the bin and opens the next.
IndexGroups concatenative(Lengths lengths, int64_t bin_capacity, int64_t max_sequences_per_bin = -1);
// Same rule as concatenative (NeMo AutoModel's greedy in-order dataset packing);
// kept as its own name because dataset-level packing refers to it.
IndexGroups greedy_sequential(Lengths lengths, int64_t bin_capacity, int64_t max_sequences_per_bin = -1);
// First fit over items sorted by (length, index) descending. O(n log n): a max-tree
// over bin gaps finds the leftmost bin that fits.
IndexGroups first_fit_decreasing(Lengths lengths, int64_t bin_capacity);
// First fit over a seeded Fisher-Yates shuffle (portable PRNG, same bins for a seed
// on every platform). O(n log n).
IndexGroups first_fit_shuffle(Lengths lengths, int64_t bin_capacity, uint64_t seed);
// Best fit (the bin with the least room that still fits; among equal room, the bin
// that reached it most recently) over items sorted by (length, index) descending.
// O(n log64 C) with a bitset over gap values for C <= 2^22, O(n log n) otherwise.
IndexGroups best_fit_decreasing(Lengths lengths, int64_t bin_capacity);

// Best fit decreasing with HF TRL's tie-breaks (trl.data_utils.pack_dataset,
// strategy "bfd"): items by length descending, equal lengths in index order; each
// goes to the bin with the smallest remaining space that holds it, among equal
// spaces the bin that reached that space first, else to a new bin. Lengths must be
// positive. With `batch_bounds` ([0, ..., n], as TRL packs each `datasets.map`
// batch on its own) bins never mix batches and come batch by batch.
IndexGroups best_fit_decreasing_fifo(Lengths lengths, int64_t bin_capacity, Lengths batch_bounds = {});
// Johnson & Garey's MFFD as NeMo-RL implements it (5 phases). Lengths must be > 0.
IndexGroups modified_first_fit_decreasing(Lengths lengths, int64_t bin_capacity);

// NeMo-RL's bin-count rule: target = max(count, min_bin_count) rounded up to a
// multiple of bin_count_multiple; each missing bin receives the last item of the
// bin that currently holds the most items (ties: higher bin index first, as a
// descending sort of (size, index) gives). Throws when there are fewer items than
// target bins.
IndexGroups adjust_bin_count(const IndexGroups& bins, int64_t min_bin_count, int64_t bin_count_multiple);

}  // namespace seqpack
