#pragma once
// Planning a training step with context parallelism: D data-parallel groups of C
// CP ranks (rank = dp_rank * C + cp_rank), every sequence sharded over an aligned
// block of d ranks of one CP group (d a power of two dividing C; d = 1: run whole by
// one rank), all its d ranks at the same micro-batch step.
//
//   C = 8, one CP group, one micro-batch step:
//   cp_rank      0    1    2    3    4    5    6    7
//   seq A d=4  [ A/4  A/4  A/4  A/4 ]                       block 0 of 4
//   seq B d=2                      [ B/2  B/2 ]             block 2 of 2
//   seq C d=1                                 [ C ]         rank 6
//   seq D d=1                                 [ D ] [ E ]   (two on rank 6)
//
// Fixed CP (hybrid = false) gives every sequence d = C, today's layout (2C zigzag
// chunks, padded to a multiple of 2C). Hybrid CP plans several sets of degrees: each
// sequence at the smallest d whose shard fits the cap (the least K/V traffic, at or
// above min_degree); each raised until its shard is no heavier than a rank's mean load
// per micro-batch; with no shard above cap / 2, cap / 4, ... tokens (finer items pack
// and balance better, at more traffic); and with no shard's work above the fixed
// plan's step / 2, / 4, ... (only the sequences that would hold a step up spread).
// Each is placed greedily (balance, best fit) and, with FSDP sync, by levels (first-fit
// decreasing height: tall shares share a micro-batch, short ones fill under them).
// The least-traffic degrees are also placed for compute alone (the CP terms zeroed).
// Kept: among the plans predicted within 1% of the fastest, and no slower than the
// fixed placement, the one that gathers the least K/V (predictions that close are
// within the model's error, the traffic is not), and of the same K/V within 1% of it
// the least compute; so hybrid is never predicted slower than fixed.
//
// A rank's share of a sequence of s tokens at degree d > 1: round_up(s, 2d) / d
// tokens (the zigzag pad), s * s / d attended pairs, and the K/V of (d - 1) / d of
// the sequence gathered from the block. Its cost in a micro-batch:
//   per_micro_batch + per_token * tokens + per_token_squared * pairs
//   + per_kv_token * K/V tokens gathered + per_collective * (sharded sequences it holds)
// and the step time is that of plan_step (StepSync) over all D * C ranks.
#include <cstdint>
#include <string>
#include <vector>

#include "seqpack/common.hpp"
#include "seqpack/step.hpp"

namespace seqpack {

// The most ranks (dp_size x cp_size) a step is planned over: far more than any cluster,
// few enough that per-rank tables stay small; more is refused by name.
inline constexpr int64_t kMaxCpRanks = int64_t{1} << 20;

struct CpCost {
  double per_kv_token = 0.0;    // per token of K/V a rank gathers (bytes x layers x passes / bandwidth)
  double per_collective = 0.0;  // per sharded sequence a rank holds in a micro-batch (latency x layers x passes)
};

struct CpStepOptions {
  StepOptions step;       // dp_size, max_tokens (per rank), cost, sync, counts, seed (squares: unused)
  int64_t cp_size = 1;    // C, a power of two
  bool hybrid = false;    // per-sequence degrees (else every sequence at C)
  int64_t min_degree = 1; // hybrid: no sequence below this degree (Megatron's min_dynamic_context_parallel_size)
  CpCost cp;
};

struct CpStepPlan {
  // Mini-batches as plan_step's, over the D * C ranks: K micro-batches per rank, cells
  // rank-major (rank * K + k) of sequence ids, a sharded sequence in the cell of each
  // rank of its block; each cell's predicted cost and tokens (<= max_tokens).
  StepPlan plan;
  std::vector<int64_t> degree;      // per sequence
  std::vector<int64_t> first_rank;  // per sequence: the first global rank of its block
  int64_t kv_tokens = 0;            // K/V tokens gathered over all ranks: sum of s * (d - 1)
  int64_t least_kv_tokens = 0;      // the same with every sequence at its smallest degree
  bool hybrid = false;              // whether a kept placement is the hybrid one
};

// A rank's tokens of a sequence of s tokens sharded at degree d.
int64_t cp_local_tokens(int64_t s, int64_t d);

// What the planner needs of each item it places (a plain sequence, or a prefix tree
// cut by attention work): its tokens, its attention work in units of s * s (a row:
// s * s; a tree: 2 * visible pairs - tokens), and the most tokens a rank of its block
// holds at each degree 2^j, j = 0 .. log2(C).
struct CpItems {
  std::vector<int64_t> tokens;
  std::vector<int64_t> squares;
  std::vector<int64_t> local;    // [n * levels], item-major
  int64_t levels = 1;            // log2(C) + 1
  std::string name = "lengths";  // how errors name an item: name[i]

  static CpItems of_lengths(Lengths lengths, int64_t cp_size);
  int64_t size() const { return static_cast<int64_t>(tokens.size()); }
  int64_t local_at(int64_t i, int64_t d) const;  // d a power of two <= C
};

CpStepPlan plan_cp_step(Lengths lengths, const CpStepOptions& options);
// Items per mini-batch: options.step.mini_batch_sizes (in order), else split evenly.
CpStepPlan plan_cp_step(const CpItems& items, const CpStepOptions& options);

}  // namespace seqpack
