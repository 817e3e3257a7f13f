#pragma once
// Shared helpers of the GoogleTest suite (header-only; included by each test file).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "seqpack/common.hpp"

namespace seqpack_test {

using Nested = std::vector<std::vector<int64_t>>;

// Passes when `f` throws std::invalid_argument whose message starts with
// "[seqpack." and contains every needle.
template <class F>
::testing::AssertionResult ThrowsInvalid(F&& f, std::initializer_list<std::string_view> needles) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    if (msg.rfind("[seqpack.", 0) != 0)
      return ::testing::AssertionFailure() << "message '" << msg << "' does not start with '[seqpack.'";
    for (std::string_view needle : needles)
      if (msg.find(needle) == std::string::npos)
        return ::testing::AssertionFailure() << "message '" << msg << "' does not mention '" << needle << "'";
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a different exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

// Well-formed CSR whose groups hold every index in [0, n) exactly once.
inline ::testing::AssertionResult IsPartition(const seqpack::IndexGroups& g, size_t n, bool allow_empty = false) {
  if (g.offsets.empty() || g.offsets.front() != 0 ||
      g.offsets.back() != static_cast<int64_t>(g.indices.size()))
    return ::testing::AssertionFailure() << "malformed offsets";
  for (size_t b = 0; b < g.size(); ++b) {
    if (g.group_size(b) < 0) return ::testing::AssertionFailure() << "offsets decrease at group " << b;
    if (!allow_empty && g.group_size(b) == 0) return ::testing::AssertionFailure() << "group " << b << " is empty";
  }
  if (g.indices.size() != n)
    return ::testing::AssertionFailure() << g.indices.size() << " indices for " << n << " items";
  std::vector<int> seen(n, 0);
  for (int64_t i : g.indices) {
    if (i < 0 || i >= static_cast<int64_t>(n)) return ::testing::AssertionFailure() << "index " << i << " out of range";
    if (seen[static_cast<size_t>(i)]++) return ::testing::AssertionFailure() << "index " << i << " appears twice";
  }
  return ::testing::AssertionSuccess();
}

inline int64_t sum_of(const std::vector<int64_t>& v) {
  int64_t s = 0;
  for (int64_t x : v) s += x;
  return s;
}

inline int64_t max_of(const std::vector<int64_t>& v) { return v.empty() ? 0 : *std::max_element(v.begin(), v.end()); }
inline int64_t min_of(const std::vector<int64_t>& v) { return v.empty() ? 0 : *std::min_element(v.begin(), v.end()); }

// Uniform in [lo, hi].
inline std::vector<int64_t> uniform_lengths(uint64_t seed, size_t n, int64_t lo, int64_t hi) {
  seqpack::Rng rng(seed);
  std::vector<int64_t> v(n);
  for (auto& x : v) x = lo + static_cast<int64_t>(rng.below(static_cast<uint64_t>(hi - lo + 1)));
  return v;
}

// exp(N(mu, sigma)) via Box-Muller on the portable Rng, rounded and clamped to [lo, hi].
inline std::vector<int64_t> lognormal_lengths(uint64_t seed, size_t n, double median, double sigma, int64_t lo,
                                              int64_t hi) {
  seqpack::Rng rng(seed);
  auto u01 = [&] { return (static_cast<double>(rng.next() >> 11) + 0.5) * 0x1.0p-53; };
  std::vector<int64_t> v(n);
  for (auto& x : v) {
    const double z = std::sqrt(-2.0 * std::log(u01())) * std::cos(2.0 * 3.14159265358979323846 * u01());
    const auto raw = static_cast<int64_t>(std::llround(median * std::exp(sigma * z)));
    x = std::clamp(raw, lo, hi);
  }
  return v;
}

// Token rows as the prefix-tree and forest builders take them: flat tokens, their
// offsets, and one group id per row (empty: one group).
struct FlatRows {
  std::vector<int64_t> tokens, cu{0}, groups;
};

inline FlatRows flatten_rows(const Nested& rows, const std::vector<int64_t>& groups = {}) {
  FlatRows f;
  for (const std::vector<int64_t>& r : rows) {
    f.tokens.insert(f.tokens.end(), r.begin(), r.end());
    f.cu.push_back(static_cast<int64_t>(f.tokens.size()));
  }
  f.groups = groups;
  return f;
}

}  // namespace seqpack_test
