"""Record NeMo AutoModel 0.7's ``pack_dataset`` and ``packed_sequence_thd_collater`` on
small datasets, for tests/python/frameworks/test_automodel.py (which replays them
without AutoModel installed).

    python tests/python/frameworks/data/make_automodel_cases.py   # writes automodel_cases.json beside it

Each case: the rows, the keyword arguments and what AutoModel returned (the packed
columns and their Arrow types), raised (the exception's type and message), or
``"garbage"``: packs whose padded lengths do not fill ``packed_sequence_size`` (a row
that fits but whose padded length does not, cut across packs), which seqpack refuses.
"""

from __future__ import annotations

import copy
import json
import logging
import pathlib

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent


def _rows(rng, n, size, mask):
    rows = []
    for _ in range(n):
        length = int(rng.integers(0, size + 4)) if rng.random() < 0.85 else 0
        row = {"input_ids": rng.integers(0, 50, length).tolist(), "labels": rng.integers(-100, 50, length).tolist()}
        if mask:
            row["loss_mask"] = rng.integers(0, 2, length).tolist()
        rows.append(row)
    return rows


def _edge_cases():
    def seq(*lengths, mask=False):
        out = []
        for i, n in enumerate(lengths):
            row = {"input_ids": [10 * (i + 1) + k for k in range(n)], "labels": [k + 1 for k in range(n)]}
            if mask:
                row["loss_mask"] = [k % 2 for k in range(n)]
            out.append(row)
        return out

    return [
        ("basic", seq(3, 4, 2, 5), dict(packed_sequence_size=10)),
        ("exact_fit", seq(5), dict(packed_sequence_size=5)),
        ("loss_mask", seq(3, 3, mask=True), dict(packed_sequence_size=5)),
        ("cp2", seq(3, 5, 1, 6), dict(packed_sequence_size=12, cp_size=2)),
        ("cp2_not_multiple_fits", seq(3, 5, 1, 6), dict(packed_sequence_size=11, cp_size=2)),
        ("cp2_not_multiple_cut", seq(3, 11, 2), dict(packed_sequence_size=11, cp_size=2)),
        ("cp2_not_multiple_first", seq(11, 2), dict(packed_sequence_size=11, cp_size=2)),
        ("pad_to_multiple_of", seq(3, 5, 1, 6), dict(packed_sequence_size=12, pad_to_multiple_of=3)),
        ("pad_to_multiple_of_bad", seq(3), dict(packed_sequence_size=10, pad_to_multiple_of=3)),
        ("lcm", seq(3, 5, 1, 6, 2), dict(packed_sequence_size=24, cp_size=2, pad_to_multiple_of=3)),
        ("drop_long", seq(3, 12, 4), dict(packed_sequence_size=8)),
        ("raise_long", seq(3, 12, 4), dict(packed_sequence_size=8, drop_long_samples=False)),
        ("all_dropped", seq(9, 12), dict(packed_sequence_size=8)),
        ("empty", [], dict(packed_sequence_size=8)),
        ("only_empty_rows", seq(0, 0), dict(packed_sequence_size=8)),
        ("empty_rows_between", seq(0, 3, 0, 5, 0, 4, 0), dict(packed_sequence_size=8)),
        ("empty_rows_full_pack", seq(8, 0, 0, 3), dict(packed_sequence_size=8)),
        ("max_packs_cut", seq(5, 5, 5, 5), dict(packed_sequence_size=8, max_packs=2)),
        ("max_packs_long_after_cut", seq(5, 5, 5, 99), dict(packed_sequence_size=8, max_packs=2,
                                                            drop_long_samples=False)),
        ("max_packs_long_before_cut", seq(5, 99, 5, 5), dict(packed_sequence_size=8, max_packs=2,
                                                             drop_long_samples=False)),
        ("max_packs_exact", seq(5, 5, 5), dict(packed_sequence_size=8, max_packs=3)),
        ("max_packs_zero", seq(5, 5), dict(packed_sequence_size=8, max_packs=0)),
        ("max_packs_zero_long", seq(99, 5), dict(packed_sequence_size=8, max_packs=0, drop_long_samples=False)),
        ("max_packs_cut_unpackable_after", seq(5, 5, 11), dict(packed_sequence_size=11, cp_size=2, max_packs=2)),
        ("padding_idx", seq(3, 2), dict(packed_sequence_size=8, padding_idx=7)),
        ("padding_idx_int64", seq(3, 2), dict(packed_sequence_size=8, padding_idx=2 ** 40)),
        ("negative_tokens", [{"input_ids": [-5, 3], "labels": [1, -1]}], dict(packed_sequence_size=4)),
        ("loss_mask_bool_float", [{"input_ids": [1, 2, 3], "labels": [4, 5, 6], "loss_mask": [1.0, 0.0, 2.5]},
                                  {"input_ids": [7], "labels": [8], "loss_mask": [0]}], dict(packed_sequence_size=6)),
        ("loss_mask_empty_is_none", [{"input_ids": [1, 2], "labels": [4, 5], "loss_mask": []}],
         dict(packed_sequence_size=4)),
        ("size_one", seq(1, 1, 2, 1), dict(packed_sequence_size=1)),
    ]


def main() -> None:
    import nemo_automodel
    from nemo_automodel.components.datasets.llm.packed_sequence import pack_dataset
    from nemo_automodel.components.datasets.utils import packed_sequence_thd_collater

    logging.disable(logging.CRITICAL)
    rng = np.random.default_rng(27)
    cases = [(name, rows, kw) for name, rows, kw in _edge_cases()]
    for k in range(80):
        size = int(rng.integers(1, 33))
        kw = dict(packed_sequence_size=size, cp_size=int(rng.choice([1, 1, 2, 3])),
                  drop_long_samples=bool(rng.random() < 0.7), padding_idx=int(rng.integers(-2, 5)))
        if rng.random() < 0.4:
            kw["max_packs"] = int(rng.integers(0, 4))
        if rng.random() < 0.3:
            kw["pad_to_multiple_of"] = int(rng.choice([d for d in range(1, size + 1) if size % d == 0]))
        cases.append((f"random_{k}", _rows(rng, int(rng.integers(0, 16)), size, rng.random() < 0.5), kw))
    recorded = []
    for name, rows, kw in cases:
        entry = {"name": name, "rows": rows, "kwargs": kw}
        try:
            out = pack_dataset(copy.deepcopy(rows), None, **kw)
        except Exception as e:  # noqa: BLE001 - recorded as AutoModel raised it
            entry["error"] = {"type": type(e).__name__, "message": str(e)}
        else:
            size = kw["packed_sequence_size"]
            if any(sum(r["seq_lens_padded"]) != size or not r["seq_lens"] for r in out):
                entry["garbage"] = True
            else:
                entry["types"] = {k: str(v) for k, v in zip(out.data.schema.names, out.data.schema.types)}
                entry["packs"] = out.to_dict()
        recorded.append(entry)
    collate = []
    for batch in ([{"input_ids": [1, 2, 0, 0], "labels": [2, -100, -100, -100], "position_ids": [0, 1, 2, 3],
                    "seq_lens": [2], "seq_lens_padded": [4]},
                   {"input_ids": [3, 4, 5, 6], "labels": [4, 5, 6, 7], "position_ids": [0, 0, 1, 2],
                    "seq_lens": [1, 3], "seq_lens_padded": [1, 3]}],
                  [{"input_ids": [1, 2, 3], "labels": [2, 3, -100], "attention_mask": [1, 1, 0],
                    "___PAD_TOKEN_IDS___": {"input_ids": 9, "labels": -100, "attention_mask": 0}},
                   {"input_ids": [4], "labels": [5], "attention_mask": [1],
                    "___PAD_TOKEN_IDS___": {"input_ids": 9, "labels": -100, "attention_mask": 0}}],
                  [{"input_ids": [1, 2], "labels": [2, -100]}, {"input_ids": [4, 5, 6], "labels": [5, 6, 7]}],
                  []):
        out = packed_sequence_thd_collater(copy.deepcopy(batch))
        collate.append({"batch": batch, "out": {k: ({"dtype": str(v.dtype), "value": v.tolist()}
                                                    if hasattr(v, "dtype") else v) for k, v in out.items()}})
    data = {"automodel": nemo_automodel.__version__, "pack_dataset": recorded, "collate": collate}
    path = HERE / "automodel_cases.json"
    path.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    print(f"{len(recorded)} pack_dataset cases, {len(collate)} collate cases -> {path}")


if __name__ == "__main__":
    main()
