// The prefix-tree builder on rows drawn from a tiny vocabulary (so rows share a lot),
// with groups, min_shared_tokens and padding, and sometimes broken offsets. Checks
// against the definition (prefix_tree.hpp): two logical tokens at one position are
// one physical token iff their rows are in one group and their common prefix is
// longer than the position and at least max(min_shared_tokens, 1); each row is a
// root-to-node path; the ancestor rule from subtree_end matches the parent chains;
// segments are contiguous single-child chains; pad tokens are roots at the end.
#include "fuzz.hpp"
#include "seqpack/prefix_tree.hpp"

using namespace seqpack;
using namespace seqpack_fuzz;

namespace {

int64_t lcp(const int64_t* a, int64_t na, const int64_t* b, int64_t nb) {
  int64_t k = 0;
  while (k < na && k < nb && a[k] == b[k]) ++k;
  return k;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  return run([&] {
    const int64_t n_rows = in.in_range(0, 12), vocab = in.in_range(1, 4);
    std::vector<int64_t> tokens, cu{0}, groups;
    for (int64_t r = 0; r < n_rows; ++r) {
      const int64_t len = in.in_range(0, 10);
      for (int64_t k = 0; k < len; ++k) tokens.push_back(in.flag() ? in.edgy(vocab) : in.in_range(0, vocab - 1));
      cu.push_back(static_cast<int64_t>(tokens.size()));
    }
    const bool grouped = in.flag();
    if (grouped)
      for (int64_t r = 0; r < n_rows; ++r) groups.push_back(in.flag() ? in.edgy(2) : 0);
    PrefixTreeOptions options;
    options.min_shared_tokens = in.flag() ? in.edgy(4) : in.in_range(0, 4);
    options.pad_to_multiple_of = in.flag() ? in.edgy(8) : in.in_range(1, 8);
    // Edges past 2^40 must throw; a real multiple of billions is valid but would only
    // measure the allocator (and the quadratic checks below).
    if (options.pad_to_multiple_of > 64 && options.pad_to_multiple_of <= (int64_t{1} << 40))
      options.pad_to_multiple_of = options.pad_to_multiple_of % 64 + 1;
    options.pad_token = in.edgy(3);
    if (in.flag() && !cu.empty()) {  // break the offsets (or the group count) now and then
      const auto i = static_cast<size_t>(in.in_range(0, static_cast<int64_t>(cu.size()) - 1));
      cu[i] = in.edgy(static_cast<int64_t>(tokens.size()) + 2);
      if (in.flag()) groups.push_back(1);
    }
    const PrefixTree t = build_prefix_tree(tokens, cu, groups, options);

    const int64_t T = t.num_tokens(), real = T - t.num_pad_tokens, m = std::max<int64_t>(options.min_shared_tokens, 1);
    FUZZ_REQUIRE(T % options.pad_to_multiple_of == 0 && t.num_pad_tokens < options.pad_to_multiple_of);
    FUZZ_REQUIRE(t.cu_seqlens == cu && t.num_logical_tokens() == static_cast<int64_t>(tokens.size()));
    const bool g = !groups.empty();
    for (int64_t r = 0; r < n_rows; ++r)
      for (int64_t s = 0; s < n_rows; ++s) {
        const int64_t nr = cu[r + 1] - cu[r], ns = cu[s + 1] - cu[s];
        const int64_t l = lcp(tokens.data() + cu[r], nr, tokens.data() + cu[s], ns);
        for (int64_t p = 0; p < std::min(nr, ns); ++p) {
          const bool shared = r == s || ((!g || groups[r] == groups[s]) && p < l && l >= m);
          FUZZ_REQUIRE((t.logical_index[cu[r] + p] == t.logical_index[cu[s] + p]) == shared);
        }
      }
    std::vector<char> reached(static_cast<size_t>(T), 0);
    for (int64_t r = 0; r < n_rows; ++r)
      for (int64_t i = cu[r]; i < cu[r + 1]; ++i) {
        const int64_t x = t.logical_index[i];
        FUZZ_REQUIRE(x >= 0 && x < real && t.input_ids[x] == tokens[i] && t.position_ids[x] == i - cu[r]);
        FUZZ_REQUIRE(t.parent[x] == (i == cu[r] ? -1 : t.logical_index[i - 1]));
        FUZZ_REQUIRE(t.first_logical[x] <= i && t.logical_index[t.first_logical[x]] == x);
        reached[x] = 1;
      }
    for (int64_t i = 0; i < real; ++i) FUZZ_REQUIRE(reached[i]);  // no node without a row
    for (int64_t i = real; i < T; ++i)
      FUZZ_REQUIRE(t.input_ids[i] == options.pad_token && t.parent[i] == -1 && t.subtree_end[i] == i + 1 &&
                   t.first_logical[i] == -1);
    for (int64_t i = 0; i < T; ++i) {
      std::vector<char> ancestor(static_cast<size_t>(T), 0);
      for (int64_t a = i; a >= 0; a = t.parent[a]) {
        FUZZ_REQUIRE(a < T && t.parent[a] < a);
        ancestor[a] = 1;
      }
      for (int64_t j = 0; j < T; ++j) FUZZ_REQUIRE((j <= i && i < t.subtree_end[j]) == (ancestor[j] != 0));
    }
    FUZZ_REQUIRE(t.segment_offsets.front() == 0 && t.segment_offsets.back() == T);
    FUZZ_REQUIRE(t.segment_parent.size() + 1 == t.segment_offsets.size());
    for (size_t s = 0; s < t.segment_parent.size(); ++s) {
      const int64_t a = t.segment_offsets[s], b = t.segment_offsets[s + 1];
      FUZZ_REQUIRE(a < b);
      for (int64_t i = a + 1; i < b; ++i) FUZZ_REQUIRE(t.parent[i] == i - 1);
      const int64_t p = t.parent[a], sp = t.segment_parent[s];
      FUZZ_REQUIRE(p < 0 ? sp == -1 : (sp >= 0 && sp < static_cast<int64_t>(s) && t.segment_offsets[sp] <= p &&
                                       p + 1 == t.segment_offsets[sp + 1]));
    }
  });
}
