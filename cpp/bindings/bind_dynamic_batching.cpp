#include <optional>

#include "convert.hpp"
#include "forest_args.hpp"
#include "seqpack/dynamic_batching.hpp"
#include "seqpack/forest_planning.hpp"

namespace seqpack::bindings {
namespace {

// [[start, end], ...] + [length, ...] as Python lists, the form ROLL's metadata takes.
std::pair<py::list, py::list> ranges_lists(const std::vector<MicroBatchRange>& ranges) {
  py::list indices, lengths;
  for (const auto& range : ranges) {
    py::list pair;
    pair.append(range.start);
    pair.append(range.end);
    indices.append(pair);
    lengths.append(range.length);
  }
  return {indices, lengths};
}

}  // namespace

void init_dynamic_batching(py::module_& m) {
  m.def(
      "split_ranges_to_multiple",
      [](const std::vector<std::pair<int64_t, int64_t>>& indices, const std::vector<int64_t>& lengths,
         int64_t pp_size) {
        if (indices.size() != lengths.size())
          throw py::value_error("micro_batch_indices and micro_batch_lengths must have the same length");
        std::vector<MicroBatchRange> ranges;
        for (size_t i = 0; i < indices.size(); ++i) ranges.push_back({indices[i].first, indices[i].second, lengths[i]});
        split_ranges_to_multiple(ranges, pp_size);
        return ranges_lists(ranges);
      },
      py::arg("micro_batch_indices"), py::arg("micro_batch_lengths"), py::arg("pp_size"));
  m.def(
      "plan_dynamic_batching",
      [](py::handle lengths, const std::string& rule, int64_t shards, int64_t batch_size, int64_t max_tokens,
         int64_t round, int64_t max_seqlen, int64_t pp_size, py::handle forest) {
        DynamicBatchingRule r;
        if (rule == "nemo_rl") r = DynamicBatchingRule::NemoRL;
        else if (rule == "roll") r = DynamicBatchingRule::Roll;
        else if (rule == "optimal") r = DynamicBatchingRule::Optimal;
        else throw py::value_error("rule must be one of 'nemo_rl', 'roll', 'optimal', got '" + rule + "'");
        LengthsArg arg(lengths, "input_lengths");
        std::optional<ForestArgs> f;
        if (!forest.is_none()) {  // PrefixForest._core_args(): the plan is over its trees
          f.emplace(forest.cast<py::tuple>());
        }
        DynamicBatchingOptions o{shards, batch_size, max_tokens, round, max_seqlen, pp_size};
        DynamicBatchingPlan plan;
        {
          py::gil_scoped_release release;
          plan = f ? plan_forest_dynamic_batching(f->view(), o) : plan_dynamic_batching(arg.view(), o, r);
        }
        py::list indices, lens;
        for (const auto& chunk : plan.chunks) {
          auto [ci, cl] = ranges_lists(chunk);
          indices.append(ci);
          lens.append(cl);
        }
        py::dict out;
        out["sorted_indices"] = py::cast(plan.sorted_indices);
        out["micro_batch_indices"] = indices;
        out["micro_batch_lengths"] = lens;
        out["shard_chunk_size"] = plan.shard_chunk_size;
        out["padded_tokens"] = plan.padded_tokens;
        out["valid_tokens"] = plan.valid_tokens;
        return out;
      },
      py::arg("input_lengths"), py::arg("rule"), py::arg("shards"), py::arg("batch_size"),
      py::arg("max_tokens_per_microbatch"), py::arg("sequence_length_round"), py::arg("max_seqlen") = 0,
      py::arg("pp_size") = 1, py::arg("forest") = py::none());
}

}  // namespace seqpack::bindings
