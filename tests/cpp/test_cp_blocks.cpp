// The block index of the CP placement (cpp/src/cp_blocks.hpp): on random raises over
// ranks that are not a power of two, every search returns what a scan of the blocks
// returns (the least key, then the lowest block, among those whose tokens fit), for
// keys that grow with the load and for the best-fit key that grows as tokens shrink,
// with and without an incumbent; the best fit over every step, what a scan returns.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "cp_blocks.hpp"

namespace {

using seqpack::detail::BlockKey;
using seqpack::detail::StepBlocks;

TEST(CpBlocks, SearchesMatchAScan) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t top = static_cast<int64_t>(rng() % 4), ranks = (int64_t{1} << top) * (1 + static_cast<int64_t>(rng() % 6));
    std::vector<int64_t> levels;
    for (int64_t j = 0; j <= top; ++j)
      if (rng() % 2 || j == top) levels.push_back(j);
    StepBlocks blocks(ranks, levels);
    std::vector<int64_t> tokens(static_cast<size_t>(ranks), 0);
    std::vector<double> load(static_cast<size_t>(ranks), 0.0);
    for (int round = 0; round < 40; ++round) {
      const auto r = static_cast<int64_t>(rng() % static_cast<uint64_t>(ranks));
      tokens[static_cast<size_t>(r)] += static_cast<int64_t>(rng() % 50);
      load[static_cast<size_t>(r)] += static_cast<double>(rng() % 7);  // ties are common
      blocks.raise(r, tokens[static_cast<size_t>(r)], load[static_cast<size_t>(r)]);
      for (int64_t j : levels) {
        const int64_t limit = static_cast<int64_t>(rng() % 400), span = int64_t{1} << j;
        const double w = 1.5, top_load = static_cast<double>(rng() % 30);
        // A scan: each block's busiest rank's tokens and load.
        auto scan = [&](auto key) {
          int64_t best = -1;
          BlockKey best_key{};
          for (int64_t b = 0; b < ranks / span; ++b) {
            int64_t t = 0;
            double l = 0.0;
            for (int64_t x = b * span; x < (b + 1) * span; ++x)
              t = std::max(t, tokens[static_cast<size_t>(x)]), l = std::max(l, load[static_cast<size_t>(x)]);
            if (t > limit) continue;
            const BlockKey k = key(t, l);
            if (best < 0 || k < best_key) best = b, best_key = k;
          }
          return best;
        };
        auto grow = [&](int64_t, double l) { return BlockKey{std::max(0.0, l + w - top_load), l + w}; };
        auto fit = [&](int64_t t, double l) { return BlockKey{static_cast<double>(limit - t), l + w}; };
        const int64_t a = blocks.best(
            j, limit, [&](int64_t q) { return grow(0, blocks.min_load(j, q)); },
            [&](int64_t q) { return grow(0, blocks.min_load(j, q)); });
        ASSERT_EQ(a, scan(grow)) << "trial " << trial << " level " << j;
        const int64_t b = blocks.best(
            j, limit, [&](int64_t q) { return fit(blocks.max_tokens(j, q), blocks.min_load(j, q)); },
            [&](int64_t q) { return fit(std::min(blocks.max_tokens(j, q), limit), blocks.min_load(j, q)); });
        ASSERT_EQ(b, scan(fit)) << "trial " << trial << " level " << j;
        if (a >= 0) {  // an incumbent: only a lower (key, block) comes back
          const BlockKey k = grow(0, blocks.min_load(j, blocks.leaves(j) + a));
          auto by_load = [&](int64_t q) { return grow(0, blocks.min_load(j, q)); };
          ASSERT_EQ(blocks.best(j, limit, by_load, by_load, a, k), -1);
          if (a > 0) {
            ASSERT_EQ(blocks.best(j, limit, by_load, by_load, a - 1, BlockKey{k.first, k.second + 1.0}), a);
          }
        }
        if (a >= 0) {
          ASSERT_LE(blocks.max_tokens(j, blocks.leaves(j) + a), limit);
        }
      }
    }
  }
}

TEST(CpBlocks, BestFitMatchesAScanOfEveryStep) {
  using seqpack::detail::BestFit;
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 100; ++trial) {
    const int64_t j = static_cast<int64_t>(rng() % 3), ranks = (int64_t{1} << j) * (1 + static_cast<int64_t>(rng() % 4));
    const int64_t steps = 1 + static_cast<int64_t>(rng() % 5), blocks = ranks >> j;
    BestFit fit(ranks, steps, {j});
    std::vector<BestFit::Entry> now;  // what each (block, step) holds
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t k = 0; k < steps; ++k) now.push_back({0, 0.0, b, k});
    for (int round = 0; round < 30; ++round) {
      BestFit::Entry& e = now[rng() % now.size()];
      const int64_t tokens = e.tokens + static_cast<int64_t>(rng() % 20);
      const double load = e.load + static_cast<double>(rng() % 3);  // equal tokens and loads are common
      fit.move(j, e, tokens, load);
      e.tokens = tokens, e.load = load;
      const int64_t limit = static_cast<int64_t>(rng() % 120);
      // the scan: the most tokens at or under the limit, then the least load, block, step
      const BestFit::Entry* want = nullptr;
      for (const BestFit::Entry& x : now)
        if (x.tokens <= limit && (!want || x < *want)) want = &x;
      const auto [b, k] = fit.find(j, limit);
      ASSERT_EQ(b, want ? want->block : -1) << "trial " << trial;
      ASSERT_EQ(k, want ? want->step : -1) << "trial " << trial;
    }
  }
}

}  // namespace
