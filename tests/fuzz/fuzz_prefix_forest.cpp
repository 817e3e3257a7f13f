// The prefix forest on rows drawn from a tiny vocabulary, with groups and
// min_shared_tokens, then costs of random subsets (sometimes with row ids or offsets
// out of range, or a forest whose arrays are broken). Checks against the prefix-tree
// layout of each subset's own rows (prefix_forest.hpp): its physical tokens and the
// sum of its position ids + 1; and that rows share a tree exactly when their first
// tokens are one node. Then the planner's items under a random cap (a cap below the
// longest row must throw), and the forest planners (forest_planning.hpp): every row
// once, every micro-batch's physical tokens within the cap and recomputed, the count
// admissible, never worse than AReaL's first-fit tries; the step and the dynamic
// batching plans within the cap with equal counts; work items drawn freely, refused
// when inconsistent, counted at most once per listing row.
#include <numeric>
#include <tuple>

#include "fuzz.hpp"
#include "seqpack/forest_items.hpp"
#include "seqpack/forest_planning.hpp"
#include "seqpack/prefix_forest.hpp"
#include "seqpack/prefix_tree.hpp"

using namespace seqpack;
using namespace seqpack_fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  return run([&] {
    const int64_t n_rows = in.in_range(0, 10), vocab = in.in_range(1, 3);
    std::vector<int64_t> tokens, cu{0}, groups;
    for (int64_t r = 0; r < n_rows; ++r) {
      const int64_t len = in.in_range(0, 8);
      for (int64_t k = 0; k < len; ++k) tokens.push_back(in.flag() ? in.edgy(vocab) : in.in_range(0, vocab - 1));
      cu.push_back(static_cast<int64_t>(tokens.size()));
    }
    if (in.flag())
      for (int64_t r = 0; r < n_rows; ++r) groups.push_back(in.flag() ? in.edgy(2) : 0);
    const int64_t min_shared = in.flag() ? in.edgy(4) : in.in_range(0, 4);
    PrefixForest f = build_prefix_forest(tokens, cu, groups, min_shared);
    const PrefixTree whole = build_prefix_tree(tokens, cu, groups, {min_shared, 1, 0});
    FUZZ_REQUIRE(f.num_nodes == whole.num_tokens());
    for (int64_t r = 0; r < n_rows; ++r)
      for (int64_t s = 0; s < n_rows; ++s) {
        const bool one = r == s || (cu[r + 1] > cu[r] && cu[s + 1] > cu[s] &&
                                    whole.logical_index[cu[r]] == whole.logical_index[cu[s]]);
        FUZZ_REQUIRE((f.tree_of_row[r] == f.tree_of_row[s]) == one);
      }

    std::vector<int64_t> rows, offsets{0};
    const int64_t n_subsets = in.in_range(0, 4);
    for (int64_t k = 0; k < n_subsets; ++k) {
      const int64_t count = in.in_range(0, 6);
      for (int64_t i = 0; i < count; ++i)
        rows.push_back(in.flag() || n_rows == 0 ? in.edgy(n_rows) : in.in_range(0, n_rows - 1));
      offsets.push_back(static_cast<int64_t>(rows.size()));
    }
    const bool mutated = in.flag() && n_rows > 0;
    if (mutated) {  // a broken forest must be refused, not read out of bounds (a still-valid one just runs)
      const auto i = static_cast<size_t>(in.in_range(0, n_rows - 1));
      switch (in.in_range(0, 3)) {
        case 0: f.row_order[i] = in.edgy(n_rows); break;
        case 1: f.adjacent_lcp[i] = in.edgy(8); break;
        case 2: f.tree_of_row[i] = in.edgy(f.num_trees); break;
        default: f.row_length[i] = in.edgy(8); break;
      }
    }
    const ForestView view = view_of(f);
    std::vector<SubsetCost> out(static_cast<size_t>(n_subsets));
    forest_subset_costs(view, rows, offsets, out);
    if (mutated) return;
    for (int64_t k = 0; k < n_subsets; ++k) {
      std::vector<int64_t> sub_tokens, sub_cu{0}, sub_groups;
      std::vector<char> seen(static_cast<size_t>(n_rows), 0);
      for (int64_t i = offsets[k]; i < offsets[k + 1]; ++i) {
        const int64_t r = rows[static_cast<size_t>(i)];
        if (seen[r]) continue;
        seen[r] = 1;
        sub_tokens.insert(sub_tokens.end(), tokens.begin() + cu[r], tokens.begin() + cu[r + 1]);
        sub_cu.push_back(static_cast<int64_t>(sub_tokens.size()));
        if (!groups.empty()) sub_groups.push_back(groups[r]);
      }
      const PrefixTree t = build_prefix_tree(sub_tokens, sub_cu, sub_groups, {min_shared, 1, 0});
      int64_t pairs = 0;
      for (int64_t p : t.position_ids) pairs += p + 1;
      FUZZ_REQUIRE(out[k].tokens == t.num_tokens() && out[k].pairs == pairs);
    }

    // Items under a cap: every row once, each item within the cap and costed exactly,
    // a tree that fits kept whole (forest_items.hpp).
    const int64_t cap = in.flag() ? in.edgy(12) : in.in_range(1, 12);
    const ForestItems items = forest_items(view, cap);
    std::vector<int64_t> placed(static_cast<size_t>(n_rows), 0), parts(static_cast<size_t>(f.num_trees), 0);
    int64_t sum = 0;
    for (size_t k = 0; k < items.rows.size(); ++k) {
      FUZZ_REQUIRE(items.tokens[k] <= cap);
      sum += items.tokens[k];
      ++parts[static_cast<size_t>(items.tree[k])];
      for (int64_t r : items.rows.group(k)) {
        ++placed[static_cast<size_t>(r)];
        FUZZ_REQUIRE(f.tree_of_row[static_cast<size_t>(r)] == items.tree[k]);
      }
    }
    for (int64_t p : placed) FUZZ_REQUIRE(p == 1);
    FUZZ_REQUIRE(items.duplicated_tokens == sum - f.num_nodes);
    std::vector<int64_t> tree_rows, tree_offsets{0};
    for (int64_t tr = 0; tr < f.num_trees; ++tr) {
      for (int64_t r = 0; r < n_rows; ++r)
        if (f.tree_of_row[static_cast<size_t>(r)] == tr) tree_rows.push_back(r);
      tree_offsets.push_back(static_cast<int64_t>(tree_rows.size()));
    }
    std::vector<SubsetCost> tree_costs(static_cast<size_t>(f.num_trees));
    forest_subset_costs(view, tree_rows, tree_offsets, tree_costs);
    for (int64_t tr = 0; tr < f.num_trees; ++tr)
      if (tree_costs[static_cast<size_t>(tr)].tokens <= cap) FUZZ_REQUIRE(parts[static_cast<size_t>(tr)] == 1);

    // The planners under the same cap, with random counts.
    auto costs_of = [&](const IndexGroups& g) {
      std::vector<SubsetCost> c(g.size());
      forest_subset_costs(view, g.indices, g.offsets, c);
      return c;
    };
    ForestPlanOptions o;
    o.max_tokens = cap;
    o.min_num = in.in_range(1, 4);
    o.multiple_of = in.in_range(1, 3);
    o.attention_coeff = in.flag() ? 8 : 0;
    o.small_at_ends = in.flag();
    o.whole_trees = in.flag();
    try {
      const ForestMicroBatchPlan plan = plan_forest_micro_batches(view, o);
      std::vector<int64_t> seen(static_cast<size_t>(n_rows), 0);
      for (int64_t r : plan.groups.indices) ++seen[static_cast<size_t>(r)];
      for (int64_t c : seen) FUZZ_REQUIRE(c == 1);
      const auto k = static_cast<int64_t>(plan.groups.size());
      FUZZ_REQUIRE(n_rows == 0 || (k >= o.min_num && k % o.multiple_of == 0 && k >= plan.lower_bound));
      const std::vector<SubsetCost> c = costs_of(plan.groups);
      int64_t total = 0;
      for (size_t g = 0; g < c.size(); ++g) {
        FUZZ_REQUIRE(c[g].tokens == plan.tokens[g] && c[g].pairs == plan.pairs[g] && c[g].tokens <= cap);
        total += c[g].tokens;
      }
      FUZZ_REQUIRE(total >= plan.physical_tokens);
      if (o.min_num == 1 && o.multiple_of == 1 && !o.whole_trees) {
        std::vector<int64_t> all(static_cast<size_t>(n_rows));
        std::iota(all.begin(), all.end(), int64_t{0});
        const IndexGroups tries = first_fit_trie(view, cap, all);
        int64_t trie_tokens = 0;
        for (const SubsetCost& t : costs_of(tries)) trie_tokens += t.tokens;
        FUZZ_REQUIRE(std::tuple(plan.groups.size(), total) <= std::tuple(tries.size(), trie_tokens));
      }
    } catch (const std::invalid_argument&) {
      // more micro-batches than rows (min_num, multiple_of): the planner says so
    }
    if (n_rows > 0) {
      StepOptions so;
      so.dp_size = in.in_range(1, 3);
      so.max_tokens = cap;
      so.cost = {in.flag() ? 5.0 : 0.0, 1.0, in.flag() ? 0.1 : 0.0};
      so.sync = in.flag() ? StepSync::Step : StepSync::MicroBatch;
      so.mini_batches = in.in_range(1, std::min<int64_t>(2, n_rows));
      const ForestStepPlan step = plan_forest_step(view, so, in.flag());
      int64_t placed = 0;
      for (const MiniBatchStep& mb : step.plan.mini_batches) {
        FUZZ_REQUIRE(static_cast<int64_t>(mb.cells.size()) == so.dp_size * mb.num_micro_batches);
        const std::vector<SubsetCost> c = costs_of(mb.cells);
        for (size_t g = 0; g < c.size(); ++g) FUZZ_REQUIRE(c[g].tokens == mb.tokens[g] && c[g].tokens <= cap);
        placed += static_cast<int64_t>(mb.cells.indices.size());
      }
      FUZZ_REQUIRE(placed == n_rows);
      DynamicBatchingOptions d;
      d.shards = n_rows % 2 == 0 ? 2 : 1;
      d.max_tokens_per_microbatch = cap;
      d.sequence_length_round = 1;
      const DynamicBatchingPlan dyn = plan_forest_dynamic_batching(view, d);
      FUZZ_REQUIRE(static_cast<int64_t>(dyn.sorted_indices.size()) == n_rows);
      for (const MicroBatchRange& r : dyn.chunks.front())
        for (int64_t sh = 0; sh < d.shards; ++sh) {
          IndexGroups g;
          const auto first = dyn.sorted_indices.begin() + sh * dyn.shard_chunk_size;
          g.push_group(std::vector<int64_t>(first + r.start, first + r.end));
          FUZZ_REQUIRE(costs_of(g).front().tokens <= cap);
        }
    }

    // Work items (a VLM's images), drawn freely: an inconsistent set is refused by
    // check_forest, never read out of bounds; a consistent one costs each subset at
    // most the items its rows list, and nothing without rows.
    std::vector<int64_t> item_offsets{0}, item_end, item_work;
    for (int64_t r = 0; r < n_rows; ++r) {
      for (int64_t k = in.in_range(0, 2); k > 0; --k) {
        item_end.push_back(in.flag() ? in.edgy(8) : in.in_range(1, 8));
        item_work.push_back(in.flag() ? in.edgy(1000) : in.in_range(0, 1000));
      }
      item_offsets.push_back(in.flag() ? in.edgy(static_cast<int64_t>(item_end.size()) + 1)
                                       : static_cast<int64_t>(item_end.size()));
    }
    ForestView with_items = view;
    with_items.item_offsets = item_offsets;
    with_items.item_end = item_end;
    with_items.item_work = item_work;
    std::vector<SubsetCost> worked(static_cast<size_t>(n_subsets));
    forest_subset_costs(with_items, rows, offsets, worked);
    for (int64_t k = 0; k < n_subsets; ++k) {
      int64_t listed = 0;
      for (int64_t i = offsets[k]; i < offsets[k + 1]; ++i) {
        const auto r = static_cast<size_t>(rows[static_cast<size_t>(i)]);
        for (int64_t j = item_offsets[r]; j < item_offsets[r + 1]; ++j) listed += item_work[static_cast<size_t>(j)];
      }
      FUZZ_REQUIRE(worked[k].work >= 0 && worked[k].work <= listed);
      FUZZ_REQUIRE(worked[k].tokens == out[k].tokens && worked[k].pairs == out[k].pairs);
    }
  });
}
