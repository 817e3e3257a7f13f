"""Records the released verl's answers (``verl.utils.seqlen_balancing``) to small
cases in ``verl_cases.json``, which ``test_verl_released.py`` checks
``seqpack.verl`` against where verl is not installed.

    cd tests/python/frameworks/data && python3 make_verl_cases.py   # needs verl (and torch)

The random inputs are drawn here, and the live differential test draws its own with
the same functions. Every case holds its inputs and verl's outcome: the micro-batch
row indices (``{"parts": ...}``) or the exception type (``{"raises": ...}``); where
verl refuses a ``max_token_len`` below the padded width, also its answer on the same
lengths without the padding (``"unpadded"``), the answer seqpack must give.
Multi-rank cases run verl itself on 2 gloo ranks.
"""

from __future__ import annotations

import json
import pathlib
import random
import sys
from typing import Any, Callable, Dict, List, Optional

HERE = pathlib.Path(__file__).resolve().parent
OUT = HERE / "verl_cases.json"
WORLD = 2


# ------------------------------------------------------------------ inputs


def random_case(rng: random.Random, max_rows: int = 40) -> Dict[str, Any]:
    """One ``rearrange_micro_batches`` case: lengths, padded width, and verl's
    arguments, drawn so that every rule (cap below the width, groups over the cap,
    more micro-batches than rows, all-padding rows, ...) comes up."""
    group = rng.choice([1, 1, 1, 2, 3])
    rows = rng.randint(1, max_rows)
    if rng.random() < 0.9:
        rows = max(group, rows - rows % group)
    width = rng.randint(1, 48)
    low = 0 if rng.random() < 0.3 else width // 2
    lengths = [rng.randint(low, width) for _ in range(rows)]
    if rng.random() < 0.03:
        lengths = [0] * rows  # all padding
    roll = rng.random()
    if roll < 0.1:
        cap = rng.randint(1, width)  # below (or at) the padded width
    elif roll < 0.2:
        cap = width
    else:
        cap = rng.randint(width, 4 * width)
    return {"lengths": lengths, "width": width, "max_token_len": cap,
            "num_batches_divided_by": rng.choice([None, None, 1, 2, 3, 4]),
            "min_num_micro_batch": rng.choice([None, None, 0, 1, 2, 3, 8, rows + 1]),
            "use_dynamic_bsz_balance": rng.random() < 0.7, "force_group_size": group}


HAND_CASES: List[Dict[str, Any]] = [
    # verl#7553's example: ceil(56 / 8) = 7 parts cannot hold 8 rows of 7 tokens.
    {"lengths": [7] * 8, "width": 7, "max_token_len": 8},
    # The shape: 71 rows, cap 72, counts in steps of 2.
    {"lengths": [36 + (i * 17) % 37 for i in range(71)], "width": 72, "max_token_len": 72,
     "num_batches_divided_by": 2},
    {"lengths": [], "width": 8, "max_token_len": 16},  # no rows: verl's max() of nothing
    {"lengths": [0, 0, 0, 0], "width": 8, "max_token_len": 16},  # all padding: verl's KK gets k = 0
    {"lengths": [0, 0, 0, 0], "width": 8, "max_token_len": 16, "min_num_micro_batch": 2},
    {"lengths": [5, 6, 7, 8], "width": 8, "max_token_len": 10, "force_group_size": 2},  # a pair over the cap
    {"lengths": [5, 6, 7], "width": 8, "max_token_len": 16, "force_group_size": 2},  # rows not a multiple
    {"lengths": [5, 6, 7], "width": 8, "max_token_len": 16, "min_num_micro_batch": 4},  # more parts than rows
    {"lengths": [5, 6, 7, 8], "width": 8, "max_token_len": 16, "num_batches_divided_by": 0},
    {"lengths": [5, 6, 7, 8], "width": 8, "max_token_len": 16, "force_group_size": 0},
    {"lengths": [5, 6, 7, 8], "width": 8, "max_token_len": 8, "num_batches_divided_by": 3},  # 3 fit? no: 4 rows
    {"lengths": [3, 3, 3, 3], "width": 32, "max_token_len": 8},  # cap below the padded width
    {"lengths": [3, 9, 3, 3], "width": 32, "max_token_len": 8},  # ... and below a row
]

DEFAULTS = {"num_batches_divided_by": None, "min_num_micro_batch": None, "use_dynamic_bsz_balance": True,
            "force_group_size": 1}


def with_defaults(case: Dict[str, Any]) -> Dict[str, Any]:
    return {**DEFAULTS, **case}


def random_dp_case(rng: random.Random) -> Dict[str, Any]:
    """A case for ``WORLD`` ranks with ``dp_group``: each rank its own lengths, the
    arguments shared. Every rank passes verl's local checks (a rank failing alone
    would leave verl's other ranks waiting in its all-reduce); the raises left are
    the ones verl agrees on (a group over the cap, too few rows on a rank)."""
    group = rng.choice([1, 1, 2])
    width = rng.randint(4, 40)
    cap = rng.randint(width, 3 * width)
    ranks = []
    for _ in range(WORLD):
        rows = group * rng.randint(1, 24 // group)
        low = 0 if rng.random() < 0.3 else width // 2
        ranks.append({"lengths": [rng.randint(low, width) for _ in range(rows)], "width": width})
    return {"ranks": ranks, "max_token_len": cap, "num_batches_divided_by": rng.choice([None, None, 2, 3]),
            "min_num_micro_batch": rng.choice([None, None, 1, 3, 6]), "use_dynamic_bsz_balance": rng.random() < 0.7,
            "force_group_size": group, "same_micro_num_in_dp": rng.random() < 0.8,
            "dp_group": "world" if rng.random() < 0.9 else None}


def random_group_case(rng: random.Random) -> Dict[str, Any]:
    """``get_group_balanced_partitions``: contiguous uids (as verl lays out a prompt's
    responses), some group counts not a multiple of ``k_partitions`` or below it."""
    k = rng.randint(1, 4)
    uids: List[Any] = []
    for g in range(rng.randint(1, 10)):
        uids += [f"p{g}"] * rng.randint(1, 4)
    return {"seqlen_list": [rng.randint(1, 300) for _ in uids], "uid_list": uids, "k_partitions": k}


# ------------------------------------------------------------------ running


def batch_of(lengths: List[int], width: int, *, tensordict: bool = False) -> Any:
    """``input_ids`` and a right-padded ``attention_mask`` of ``[rows, width]``."""
    import torch

    n = torch.tensor(lengths, dtype=torch.long).reshape(-1)
    mask = (torch.arange(width)[None, :] < n[:, None]).long()
    data = {"input_ids": torch.arange(len(lengths))[:, None].expand(-1, width).contiguous(), "attention_mask": mask}
    if tensordict:
        from tensordict import TensorDict

        return TensorDict(data, batch_size=[len(lengths)])
    return data


def outcome(fn: Callable[[], Any]) -> Dict[str, Any]:
    try:
        parts = fn()
    except Exception as exc:  # noqa: BLE001 - the outcome recorded
        return {"raises": type(exc).__name__}
    return {"parts": [[int(i) for i in p] for p in parts]}


def rearrange_args(case: Dict[str, Any]) -> tuple:
    c = with_defaults(case)
    return (c["max_token_len"], None, c["num_batches_divided_by"], True, c["min_num_micro_batch"],
            c["use_dynamic_bsz_balance"], c["force_group_size"])


def verl_rearrange(case: Dict[str, Any], width: Optional[int] = None, dp_group=None,
                   same_micro_num_in_dp: bool = True) -> Dict[str, Any]:
    from verl.utils.seqlen_balancing import rearrange_micro_batches

    cap, _, divisor, _, min_num, balance, group = rearrange_args(case)
    batch = batch_of(case["lengths"], case["width"] if width is None else width, tensordict=True)
    return outcome(lambda: rearrange_micro_batches(batch, cap, dp_group, divisor, same_micro_num_in_dp, min_num,
                                                   balance, group)[1])


def verl_record(case: Dict[str, Any]) -> Dict[str, Any]:
    """verl's outcome, plus its answer without the padding where it refused a cap
    below the padded width."""
    got = verl_rearrange(case)
    if got.get("raises") == "AssertionError" and case["max_token_len"] < case["width"] and case["lengths"]:
        got["unpadded"] = verl_rearrange(case, width=max(1, *case["lengths"]))
    return got


def dp_rank_case(rank: int, world: int, case: Dict[str, Any], impl: str) -> Dict[str, Any]:
    """Rank ``rank``'s outcome of a :func:`random_dp_case` with ``impl`` (``"verl"``
    or ``"seqpack"``, seqpack's ``strict=False``)."""
    import torch.distributed as dist

    mine = {**case, **case["ranks"][rank]}
    group = dist.group.WORLD if case["dp_group"] == "world" else None
    if impl == "verl":
        import torch
        from verl.utils import seqlen_balancing

        if not torch.cuda.is_available():  # verl puts its all-reduce tensors on get_device_name(): "cuda" here
            seqlen_balancing.get_device_name = lambda: "cpu"
        return verl_rearrange(mine, dp_group=group, same_micro_num_in_dp=case["same_micro_num_in_dp"])
    from seqpack.verl import rearrange_micro_batches

    cap, _, divisor, _, min_num, balance, size = rearrange_args(mine)
    batch = batch_of(mine["lengths"], mine["width"])
    return outcome(lambda: rearrange_micro_batches(batch, cap, group, divisor, case["same_micro_num_in_dp"], min_num,
                                                   balance, size, strict=False)[1])


def verl_group_balanced(case: Dict[str, Any]) -> Dict[str, Any]:
    from verl.utils.seqlen_balancing import get_group_balanced_partitions

    return outcome(lambda: get_group_balanced_partitions(case["seqlen_list"], case["uid_list"], case["k_partitions"]))


# ------------------------------------------------------------------ recording


def dumps(data: Dict[str, Any]) -> str:
    """JSON with one case a line (readable diffs when the cases are recorded again)."""
    out = []
    for key, value in data.items():
        if isinstance(value, list):
            rows = ",\n    ".join(json.dumps(case, separators=(",", ":")) for case in value)
            out.append(f"  {json.dumps(key)}: [\n    {rows}\n  ]")
        else:
            out.append(f"  {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(out) + "\n}\n"


def main() -> None:
    import verl

    sys.path.insert(0, str(HERE.parents[1]))  # tests/python, for _gloo
    from _gloo import RankPool

    rng = random.Random(27)
    single = [with_defaults(c) for c in HAND_CASES] + [random_case(rng) for _ in range(300)]
    for case in single:
        case["verl"] = verl_record(case)
    dp = [random_dp_case(rng) for _ in range(60)]
    with RankPool(WORLD) as pool:
        for case in dp:
            outs = pool.run(dp_rank_case, case, "verl", timeout_s=60)
            assert all(o.raised is None for o in outs), [o.trace for o in outs]
            case["verl"] = [o.value for o in outs]
    groups = [random_group_case(rng) for _ in range(60)]
    for case in groups:
        case["verl"] = verl_group_balanced(case)
    data = {"verl_version": verl.__version__, "generator": "tests/python/frameworks/data/make_verl_cases.py",
            "rearrange_micro_batches": single, "rearrange_micro_batches_dp": dp,
            "get_group_balanced_partitions": groups}
    OUT.write_text(dumps(data))
    print(f"{OUT}: {len(single)} + {len(dp)} DP + {len(groups)} group cases (verl {verl.__version__})")


if __name__ == "__main__":
    main()
