#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <set>
#include <string>

#include "seqpack/packing.hpp"
#include "test_helpers.hpp"

namespace {

using namespace seqpack;
using seqpack_test::IsPartition;
using seqpack_test::Nested;
using seqpack_test::ThrowsInvalid;
using Vec = std::vector<int64_t>;

const Vec kTens = {10, 20, 30, 40, 50, 60, 70, 80, 90};
const Vec kThirties = {30, 30, 30, 30, 30};

Nested run(PackingAlgorithm a, const Vec& lengths, int64_t capacity, uint64_t seed = 0) {
  PackOptions o;
  o.bin_capacity = capacity;
  o.seed = seed;
  return pack(a, lengths, o).to_nested();
}

// Packing invariants: a partition of all indices, no empty bin, no bin over
// capacity, at least ceil(sum / capacity) bins.
::testing::AssertionResult IsValidPacking(const IndexGroups& bins, const Vec& lengths, int64_t capacity) {
  auto part = IsPartition(bins, lengths.size());
  if (!part) return part;
  const Vec loads = group_sums(bins, lengths);
  for (size_t b = 0; b < loads.size(); ++b)
    if (loads[b] > capacity) return ::testing::AssertionFailure() << "bin " << b << " holds " << loads[b];
  const int64_t lower = ceil_div(seqpack_test::sum_of(lengths), capacity);
  if (static_cast<int64_t>(bins.size()) < lower)
    return ::testing::AssertionFailure() << bins.size() << " bins < lower bound " << lower;
  return ::testing::AssertionSuccess();
}

// Indices by (length, index) descending.
Vec decreasing(const Vec& lengths) {
  Vec order(lengths.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return lengths[a] != lengths[b] ? lengths[a] > lengths[b] : a > b;
  });
  return order;
}

// Naive O(n * bins) reference packers; `best` picks the tightest bin that fits
// (ties: the bin updated most recently, as packing.hpp specifies) instead of the first.
Nested naive_decreasing_fit(const Vec& lengths, int64_t capacity, bool best) {
  Nested bins;
  Vec loads, updated;
  int64_t step = 0;
  for (int64_t item : decreasing(lengths)) {
    const int64_t len = lengths[item];
    int64_t chosen = -1;
    for (size_t b = 0; b < bins.size(); ++b) {
      const int64_t room = capacity - loads[b];
      if (room < len) continue;
      if (!best) {
        chosen = static_cast<int64_t>(b);
        break;
      }
      const int64_t best_room = chosen < 0 ? 0 : capacity - loads[chosen];
      if (chosen < 0 || room < best_room || (room == best_room && updated[b] > updated[chosen]))
        chosen = static_cast<int64_t>(b);
    }
    if (chosen < 0) {
      bins.emplace_back();
      loads.push_back(0);
      updated.push_back(0);
      chosen = static_cast<int64_t>(bins.size()) - 1;
    }
    bins[chosen].push_back(item);
    loads[chosen] += len;
    updated[chosen] = ++step;
  }
  return bins;
}

// NeMo-RL v0.6's MFFD transcribed with plain list scans (the shape of
// python/seqpack/reference.py), without the empty leftover bin.
Nested naive_mffd(const Vec& lengths, int64_t C) {
  using Item = std::pair<int64_t, int64_t>;  // (index, size)
  std::vector<Item> large, medium, small, rest;
  for (size_t i = 0; i < lengths.size(); ++i) {
    const int64_t s = lengths[i];
    auto& cls = 2 * s > C ? large : 3 * s > C ? medium : 6 * s > C ? small : rest;
    cls.emplace_back(static_cast<int64_t>(i), s);
  }
  auto by_size = [](std::vector<Item>& v, bool desc) {
    std::stable_sort(v.begin(), v.end(), [&](const Item& a, const Item& b) {
      return desc ? a.second > b.second : a.second < b.second;
    });
  };
  by_size(large, true);
  by_size(medium, true);
  by_size(small, false);
  by_size(rest, false);
  std::vector<std::vector<Item>> bins;
  for (const Item& it : large) bins.push_back({it});
  auto room_of = [&](const std::vector<Item>& b) {
    int64_t room = C;
    for (const Item& it : b) room -= it.second;
    return room;
  };
  for (auto& b : bins)  // phase 2
    for (size_t j = 0; j < medium.size(); ++j)
      if (medium[j].second <= room_of(b)) {
        b.push_back(medium[j]);
        medium.erase(medium.begin() + static_cast<std::ptrdiff_t>(j));
        break;
      }
  for (size_t r = bins.size(); r-- > 0;) {  // phase 3
    auto& b = bins[r];
    const bool has_medium =
        std::any_of(b.begin(), b.end(), [&](const Item& it) { return 3 * it.second > C && 2 * it.second <= C; });
    const int64_t room = room_of(b);
    if (has_medium || small.size() < 2 || small[0].second + small[1].second > room) continue;
    const Item first = small.front();
    small.erase(small.begin());
    for (size_t j = small.size(); j-- > 0;)
      if (small[j].second <= room - first.second) {
        b.push_back(first);
        b.push_back(small[j]);
        small.erase(small.begin() + static_cast<std::ptrdiff_t>(j));
        break;
      }
  }
  rest.insert(rest.begin(), small.begin(), small.end());
  rest.insert(rest.begin(), medium.begin(), medium.end());
  by_size(rest, true);
  for (auto& b : bins)  // phase 4
    while (!rest.empty() && room_of(b) >= rest.back().second) {
      auto it = std::find_if(rest.begin(), rest.end(), [&](const Item& x) { return x.second <= room_of(b); });
      b.push_back(*it);
      rest.erase(it);
    }
  std::vector<std::vector<Item>> left{{}};  // phase 5, kept sorted by load
  Vec left_loads{0};
  for (const Item& it : rest) {
    std::vector<Item> b;
    int64_t l = 0;
    if (it.second <= C - left_loads[0]) {
      b = left.front();
      l = left_loads.front();
      left.erase(left.begin());
      left_loads.erase(left_loads.begin());
    }
    b.push_back(it);
    l += it.second;
    const auto k = std::upper_bound(left_loads.begin(), left_loads.end(), l) - left_loads.begin();
    left.insert(left.begin() + k, b);
    left_loads.insert(left_loads.begin() + k, l);
  }
  bins.insert(bins.end(), left.begin(), left.end());
  Nested out;
  for (const auto& b : bins) {
    if (b.empty()) continue;
    out.emplace_back();
    for (const Item& it : b) out.back().push_back(it.first);
  }
  return out;
}

struct RandomCase {
  uint64_t seed;
  size_t n;
  int64_t capacity;
  bool lognormal;
  int64_t lo, hi;  // uniform range (lognormal: clamp range)
};

Vec make_lengths(const RandomCase& c) {
  if (c.lognormal) return seqpack_test::lognormal_lengths(c.seed, c.n, c.capacity / 5.0, 1.0, c.lo, c.hi);
  return seqpack_test::uniform_lengths(c.seed, c.n, c.lo, c.hi);
}

const std::vector<RandomCase> kCases = {
    {1, 50, 100, false, 1, 100},       {2, 1000, 100, false, 1, 100},   {3, 5000, 8192, true, 1, 8192},
    {4, 3000, 4096, true, 1, 4096},    {5, 2000, 1000, false, 0, 1000},  // zero lengths included
    {6, 500, 100, false, 20, 30},      // many ties
    {7, 4000, 100, false, 1, 60},      {8, 1, 100, false, 100, 100},
    // Lengths far above n and capacities above 2^22 take the comparison-based paths.
    {9, 50, 100000, false, 1, 100000}, {10, 2000, int64_t{1} << 23, true, 1, int64_t{1} << 23},
    {11, 3000, int64_t{1} << 23, false, 1, 5000},
};

// MFFD needs positive lengths.
Vec positive(Vec v) {
  for (auto& x : v) x = std::max<int64_t>(x, 1);
  return v;
}

TEST(Packing, FirstFitDecreasingGolden) {
  EXPECT_EQ(first_fit_decreasing(kThirties, 100).to_nested(), (Nested{{4, 3, 2}, {1, 0}}));
  EXPECT_EQ(first_fit_decreasing(kTens, 100).to_nested(), (Nested{{8, 0}, {7, 1}, {6, 2}, {5, 3}, {4}}));
}

TEST(Packing, ModifiedFirstFitDecreasingGolden) {
  EXPECT_EQ(modified_first_fit_decreasing(Vec{46, 24, 55, 88, 11, 14, 73, 17}, 100).to_nested(),
            (Nested{{3, 4}, {6, 5}, {2, 7, 1}, {0}}));
  EXPECT_EQ(modified_first_fit_decreasing(kThirties, 100).to_nested(), (Nested{{3, 4}, {0, 1, 2}}));
  PackOptions o;
  o.bin_capacity = 100;
  o.min_bin_count = 7;
  EXPECT_EQ(pack(PackingAlgorithm::ModifiedFirstFitDecreasing, kTens, o).to_nested(),
            (Nested{{8, 0}, {7, 1}, {6}, {5}, {4}, {3}, {2}}));
}

TEST(Packing, ModifiedFirstFitDecreasingNoEmptyBin) {
  EXPECT_EQ(modified_first_fit_decreasing(Vec{60, 70}, 100).to_nested(), (Nested{{1}, {0}}));
  EXPECT_EQ(modified_first_fit_decreasing(Vec{}, 100).size(), 0u);
}

TEST(Packing, ConcatenativeGolden) {
  const Vec lengths = {4, 1, 3, 2, 1, 3, 4, 5};
  EXPECT_EQ(concatenative(lengths, 5).to_nested(), (Nested{{0, 1}, {2, 3}, {4, 5}, {6}, {7}}));
  EXPECT_EQ(concatenative(lengths, 8).to_nested(), (Nested{{0, 1, 2}, {3, 4, 5}, {6}, {7}}));
  EXPECT_EQ(greedy_sequential(lengths, 5), concatenative(lengths, 5));
  EXPECT_EQ(greedy_sequential(lengths, 8), concatenative(lengths, 8));
  EXPECT_EQ(concatenative(Vec{}, 8).size(), 0u);
}

TEST(Packing, ConcatenativeMaxSequencesPerBin) {
  EXPECT_EQ(concatenative(Vec{1, 1, 1, 1, 1}, 100, 2).to_nested(), (Nested{{0, 1}, {2, 3}, {4}}));
  EXPECT_EQ(greedy_sequential(Vec{1, 1, 1, 1, 1}, 100, 1).size(), 5u);
  EXPECT_TRUE(ThrowsInvalid([] { concatenative(Vec{1}, 10, 0); }, {"max_sequences_per_bin"}));
  EXPECT_TRUE(ThrowsInvalid([] { concatenative(Vec{1}, 10, -2); }, {"max_sequences_per_bin"}));
}

TEST(Packing, InvariantsOfEveryAlgorithm) {
  for (const RandomCase& c : kCases) {
    for (PackingAlgorithm a : all_algorithms()) {
      SCOPED_TRACE(std::string(algorithm_name(a)) + " case seed " + std::to_string(c.seed));
      const Vec lengths = a == PackingAlgorithm::ModifiedFirstFitDecreasing ? positive(make_lengths(c)) : make_lengths(c);
      PackOptions o;
      o.bin_capacity = c.capacity;
      o.seed = c.seed;
      const IndexGroups bins = pack(a, lengths, o);
      EXPECT_TRUE(IsValidPacking(bins, lengths, c.capacity));
      EXPECT_EQ(pack(a, lengths, o), bins) << "not deterministic";
    }
  }
}

TEST(Packing, ConcatenativeKeepsOrderAndClosesBinsOnlyWhenFull) {
  for (const RandomCase& c : kCases) {
    const Vec lengths = make_lengths(c);
    const IndexGroups bins = concatenative(lengths, c.capacity);
    Vec expected(lengths.size());
    std::iota(expected.begin(), expected.end(), 0);
    EXPECT_EQ(bins.indices, expected);
    const Vec loads = group_sums(bins, lengths);
    for (size_t b = 0; b + 1 < bins.size(); ++b)
      EXPECT_GT(loads[b] + lengths[bins.group(b + 1)[0]], c.capacity) << "bin " << b << " closed early";
    EXPECT_EQ(greedy_sequential(lengths, c.capacity), bins);
  }
}

TEST(Packing, FirstFitDecreasingMatchesNaive) {
  for (const RandomCase& c : kCases) {
    SCOPED_TRACE("case seed " + std::to_string(c.seed));
    const Vec lengths = make_lengths(c);
    EXPECT_EQ(first_fit_decreasing(lengths, c.capacity).to_nested(), naive_decreasing_fit(lengths, c.capacity, false));
  }
}

TEST(Packing, BestFitDecreasingMatchesNaive) {
  int differs_from_first_fit = 0;
  for (const RandomCase& c : kCases) {
    SCOPED_TRACE("case seed " + std::to_string(c.seed));
    const Vec lengths = make_lengths(c);
    const Nested expected = naive_decreasing_fit(lengths, c.capacity, true);
    EXPECT_EQ(best_fit_decreasing(lengths, c.capacity).to_nested(), expected);
    differs_from_first_fit += expected != naive_decreasing_fit(lengths, c.capacity, false);
  }
  EXPECT_GE(differs_from_first_fit, 2) << "the random cases do not tell best fit from first fit";
}

TEST(Packing, DecreasingFitsAreScaleInvariant) {
  // Many equal rooms; scaled by 2^20 the capacity exceeds 2^22, which takes the
  // comparison-based code paths. Ties must resolve the same way on both.
  const Vec small = seqpack_test::uniform_lengths(21, 3000, 1, 25);
  Vec big = small;
  for (auto& x : big) x <<= 20;
  const int64_t cap = 100, big_cap = cap << 20;
  EXPECT_EQ(best_fit_decreasing(big, big_cap), best_fit_decreasing(small, cap));
  EXPECT_EQ(best_fit_decreasing(big, big_cap).to_nested(), naive_decreasing_fit(big, big_cap, true));
  EXPECT_EQ(first_fit_decreasing(big, big_cap), first_fit_decreasing(small, cap));
  EXPECT_EQ(modified_first_fit_decreasing(big, big_cap), modified_first_fit_decreasing(small, cap));
  EXPECT_EQ(first_fit_shuffle(big, big_cap, 3), first_fit_shuffle(small, cap, 3));
}

TEST(Packing, FirstFitGrowsPastTheExpectedBinCount) {
  // Items just over half the capacity need one bin each, about twice the L1 bound
  // the gap tree is sized for, so it must grow (several times for n = 5000); the
  // int32 and int64 rooms (capacity beyond 2^31) must agree with the naive scan.
  for (int64_t capacity : {int64_t{10}, int64_t{1000}, int64_t{1} << 32}) {
    for (size_t n : {3u, 70u, 5000u}) {
      Vec lengths(n, capacity / 2 + 1);
      lengths.insert(lengths.end(), n / 3, capacity / 2 - 1);
      lengths.insert(lengths.end(), n, 1);
      EXPECT_EQ(first_fit_decreasing(lengths, capacity).to_nested(), naive_decreasing_fit(lengths, capacity, false))
          << "capacity " << capacity << ", n " << n;
    }
  }
}

TEST(Packing, BestFitDiffersFromFirstFit) {
  // 70 -> bin 0 (room 30); 40 (index 2 first) and 40 -> bin 1 (room 20); 10 goes
  // to the first bin with room (bin 0) or to the tightest (bin 1).
  const Vec lengths = {70, 40, 40, 10};
  EXPECT_EQ(first_fit_decreasing(lengths, 100).to_nested(), (Nested{{0, 3}, {2, 1}}));
  EXPECT_EQ(best_fit_decreasing(lengths, 100).to_nested(), (Nested{{0}, {2, 1, 3}}));
  // Equal rooms: best fit takes the bin that reached its room most recently
  // (bin 1, opened by the second 80), first fit the lowest bin.
  EXPECT_EQ(best_fit_decreasing(Vec{80, 80, 20}, 100).to_nested(), (Nested{{1}, {0, 2}}));
  EXPECT_EQ(first_fit_decreasing(Vec{80, 80, 20}, 100).to_nested(), (Nested{{1, 2}, {0}}));
}

TEST(Packing, ModifiedFirstFitDecreasingMatchesNaive) {
  for (const RandomCase& c : kCases) {
    SCOPED_TRACE("case seed " + std::to_string(c.seed));
    const Vec lengths = positive(make_lengths(c));
    EXPECT_EQ(modified_first_fit_decreasing(lengths, c.capacity).to_nested(), naive_mffd(lengths, c.capacity));
  }
  // Boundary sizes of the classes (C/2, C/3, C/6 exactly) and many ties.
  for (uint64_t seed = 1; seed <= 20; ++seed) {
    Vec lengths = seqpack_test::uniform_lengths(seed, 40 + 10 * seed, 1, 12);
    for (auto& x : lengths) x *= 5;  // multiples of 5 up to 60 with capacity 60
    SCOPED_TRACE("boundary seed " + std::to_string(seed));
    EXPECT_EQ(modified_first_fit_decreasing(lengths, 60).to_nested(), naive_mffd(lengths, 60));
  }
}

TEST(Packing, FirstFitShuffleSeeds) {
  const Vec lengths = seqpack_test::uniform_lengths(42, 200, 1, 100);
  EXPECT_EQ(first_fit_shuffle(lengths, 100, 7), first_fit_shuffle(lengths, 100, 7));
  int differing = 0;
  for (uint64_t seed = 1; seed <= 5; ++seed)
    differing += first_fit_shuffle(lengths, 100, seed) != first_fit_shuffle(lengths, 100, seed + 100);
  EXPECT_GE(differing, 4);
  PackOptions o;
  o.bin_capacity = 100;
  o.seed = 9;
  EXPECT_EQ(pack(PackingAlgorithm::FirstFitShuffle, lengths, o), first_fit_shuffle(lengths, 100, 9));
}

TEST(Packing, PackDispatchesToEachAlgorithm) {
  const Vec lengths = seqpack_test::uniform_lengths(3, 300, 1, 90);
  EXPECT_EQ(run(PackingAlgorithm::Concatenative, lengths, 100), concatenative(lengths, 100).to_nested());
  EXPECT_EQ(run(PackingAlgorithm::GreedySequential, lengths, 100), greedy_sequential(lengths, 100).to_nested());
  EXPECT_EQ(run(PackingAlgorithm::FirstFitDecreasing, lengths, 100), first_fit_decreasing(lengths, 100).to_nested());
  EXPECT_EQ(run(PackingAlgorithm::BestFitDecreasing, lengths, 100), best_fit_decreasing(lengths, 100).to_nested());
  EXPECT_EQ(run(PackingAlgorithm::ModifiedFirstFitDecreasing, lengths, 100),
            modified_first_fit_decreasing(lengths, 100).to_nested());
  EXPECT_EQ(run(PackingAlgorithm::FirstFitShuffle, lengths, 100, 5), first_fit_shuffle(lengths, 100, 5).to_nested());
}

TEST(Packing, AdjustBinCount) {
  const IndexGroups ffd = first_fit_decreasing(kTens, 100);  // [[8,0],[7,1],[6,2],[5,3],[4]]
  EXPECT_EQ(adjust_bin_count(ffd, 0, 1), ffd);
  EXPECT_EQ(adjust_bin_count(ffd, 5, 1), ffd);
  EXPECT_EQ(adjust_bin_count(ffd, 0, 5), ffd);
  EXPECT_EQ(adjust_bin_count(ffd, 6, 1).to_nested(), (Nested{{8, 0}, {7, 1}, {6, 2}, {5}, {4}, {3}}));
  EXPECT_EQ(adjust_bin_count(ffd, 0, 4).to_nested(), (Nested{{8, 0}, {7}, {6}, {5}, {4}, {3}, {2}, {1}}));
  EXPECT_EQ(adjust_bin_count(ffd, 9, 1).size(), 9u);
  // min_bin_count 6 rounded up to a multiple of 4.
  const IndexGroups eight = adjust_bin_count(ffd, 6, 4);
  EXPECT_EQ(eight.size(), 8u);
  EXPECT_TRUE(IsPartition(eight, kTens.size()));
  // The largest bin gives its last item first (ties: higher bin index).
  EXPECT_EQ(adjust_bin_count(IndexGroups::from_nested({{0, 1}, {2, 3, 4}, {5}}), 4, 1).to_nested(),
            (Nested{{0, 1}, {2, 3}, {5}, {4}}));
  EXPECT_TRUE(ThrowsInvalid([&] { adjust_bin_count(ffd, 10, 1); }, {"Cannot create", "10"}));
  EXPECT_TRUE(ThrowsInvalid([&] { adjust_bin_count(ffd, 0, 10); }, {"Cannot create"}));
  EXPECT_TRUE(ThrowsInvalid([&] { adjust_bin_count(ffd, -1, 1); }, {"min_bin_count"}));
  EXPECT_TRUE(ThrowsInvalid([&] { adjust_bin_count(ffd, 0, 0); }, {"bin_count_multiple"}));
}

TEST(Packing, PackAppliesCountConstraintsToEveryAlgorithm) {
  const Vec lengths = seqpack_test::uniform_lengths(11, 400, 1, 100);
  for (PackingAlgorithm a : all_algorithms()) {
    SCOPED_TRACE(algorithm_name(a));
    PackOptions o;
    o.bin_capacity = 100;
    o.min_bin_count = 301;
    o.bin_count_multiple = 8;
    const IndexGroups bins = pack(a, lengths, o);
    EXPECT_EQ(bins.size(), 304u);
    EXPECT_TRUE(IsValidPacking(bins, lengths, 100));
    o.min_bin_count = -1;
    EXPECT_TRUE(ThrowsInvalid([&] { pack(a, lengths, o); }, {"min_bin_count"}));
    o.min_bin_count = 0;
    o.bin_count_multiple = 0;
    EXPECT_TRUE(ThrowsInvalid([&] { pack(a, lengths, o); }, {"bin_count_multiple"}));
  }
}

TEST(Packing, InvalidArguments) {
  for (PackingAlgorithm a : all_algorithms()) {
    SCOPED_TRACE(algorithm_name(a));
    EXPECT_TRUE(ThrowsInvalid([&] { run(a, Vec{10, 101, 5}, 100); }, {"sequence_lengths", "bin_capacity", "101"}));
    EXPECT_TRUE(ThrowsInvalid([&] { run(a, Vec{10}, 0); }, {"bin_capacity"}));
    EXPECT_TRUE(ThrowsInvalid([&] { run(a, Vec{10}, -5); }, {"bin_capacity"}));
    EXPECT_TRUE(ThrowsInvalid([&] { run(a, Vec{10, -1}, 100); }, {"sequence_lengths"}));
  }
  EXPECT_TRUE(ThrowsInvalid([] { modified_first_fit_decreasing(Vec{10, 0, 5}, 100); }, {"sequence_lengths"}));
  // The other packers accept zero lengths.
  EXPECT_TRUE(IsValidPacking(first_fit_decreasing(Vec{0, 0, 5}, 100), Vec{0, 0, 5}, 100));
}

TEST(Packing, ParseAlgorithm) {
  for (PackingAlgorithm a : all_algorithms()) {
    EXPECT_EQ(parse_algorithm(algorithm_name(a)), a);
    std::string upper = algorithm_name(a);
    for (char& ch : upper) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
    EXPECT_EQ(parse_algorithm(upper), a);
  }
  EXPECT_EQ(parse_algorithm("First_Fit_Decreasing"), PackingAlgorithm::FirstFitDecreasing);
  EXPECT_EQ(all_algorithms().size(), 6u);
  std::set<std::string> names;
  for (PackingAlgorithm a : all_algorithms()) names.insert(algorithm_name(a));
  EXPECT_EQ(names.size(), 6u);
  EXPECT_TRUE(ThrowsInvalid([] { parse_algorithm("first_fit"); },
                            {"first_fit", "concatenative", "first_fit_decreasing", "first_fit_shuffle",
                             "modified_first_fit_decreasing", "best_fit_decreasing", "greedy_sequential"}));
  EXPECT_TRUE(ThrowsInvalid([] { parse_algorithm(""); }, {"algorithm"}));
}

// TRL's pack_dataset docstring: lengths 5, 2, 3, 1 truncated to 4.
TEST(BestFitDecreasingFifo, TrlDocstringExample) {
  EXPECT_EQ(best_fit_decreasing_fifo(Vec{4, 2, 3, 1}, 4).to_nested(), (Nested{{0}, {2, 3}, {1}}));
}

// Equal lengths in index order; equal spaces first come first served (the plain
// best_fit_decreasing breaks both ties the other way, as NeMo-RL's).
TEST(BestFitDecreasingFifo, TiesAsTrl) {
  EXPECT_EQ(best_fit_decreasing_fifo(Vec{3, 3, 1, 1}, 4).to_nested(), (Nested{{0, 2}, {1, 3}}));
  const int64_t huge = int64_t{1} << 40;  // the ordered-set path, same rule
  EXPECT_EQ(best_fit_decreasing_fifo(Vec{3, 3, huge - 3, huge - 3}, huge).to_nested(), (Nested{{2, 0}, {3, 1}}));
}

TEST(BestFitDecreasingFifo, BatchesArePackedApart) {
  const Vec lengths{3, 1, 3, 1};
  EXPECT_EQ(best_fit_decreasing_fifo(lengths, 4).to_nested(), (Nested{{0, 1}, {2, 3}}));
  EXPECT_EQ(best_fit_decreasing_fifo(lengths, 4, Vec{0, 1, 4}).to_nested(), (Nested{{0}, {2, 1}, {3}}));
  EXPECT_TRUE(ThrowsInvalid([&] { best_fit_decreasing_fifo(lengths, 4, Vec{0, 3}); }, {"batch_bounds"}));
  EXPECT_TRUE(ThrowsInvalid([&] { best_fit_decreasing_fifo(Vec{0, 1}, 4); }, {"positive"}));
}

}  // namespace
