"""Writes hf_flattening_cases.json: transformers' DataCollatorWithFlattening on
random batches (empty examples, labels or none) under every combination of its
options, "pt" and "np", and a call-time separator_id; read by
tests/python/frameworks/test_hf_collator.py, which needs no transformers.

    python tests/python/frameworks/data/make_hf_cases.py   # transformers 5.24
"""

import itertools
import json
import pathlib
import random

import numpy as np
import transformers
from transformers import DataCollatorWithFlattening

OUT = pathlib.Path(__file__).with_name("hf_flattening_cases.json")


def encode(value):
    if isinstance(value, int):
        return {"int": value}
    array = np.asarray(value.numpy() if hasattr(value, "numpy") else value)
    kind = "pt" if hasattr(value, "numpy") else "np"
    return {"kind": kind, "dtype": str(value.dtype).replace("torch.", ""), "shape": list(array.shape),
            "values": array.tolist()}


def batch(rng):
    labels = rng.random() < 0.5
    out = []
    for _ in range(rng.randint(1, 5)):
        n = rng.choice([0, 1, 1, 2, 3, 5, 8, 13])
        example = {"input_ids": [rng.randint(0, 1000) for _ in range(n)]}
        if labels:
            example["labels"] = [rng.choice([-100, rng.randint(0, 1000)]) for _ in range(n)]
        out.append(example)
    if all(not e["input_ids"] for e in out):
        out[rng.randrange(len(out))]["input_ids"] = [7]
        if labels:
            out[0]["labels"] = [5] * len(out[0]["input_ids"])
    return out


def main():
    rng = random.Random(27)
    cases = []
    options = itertools.product([True, False], [True, False], [True, False], [0, 2], [-100, -1])
    for position_ids, flash, seq_idx, start, sep in options:
        for return_tensors in ("pt", "np"):
            for _ in range(2):
                features = batch(rng)
                init = dict(return_position_ids=position_ids, return_flash_attn_kwargs=flash,
                            return_seq_idx=seq_idx, position_ids_start=start, separator_id=sep)
                call = {} if rng.random() < 0.7 else {"separator_id": rng.choice([-100, 0, 99])}
                collator = DataCollatorWithFlattening(return_tensors=return_tensors, **init)
                out = collator(features, **call)
                cases.append({"init": {**init, "return_tensors": return_tensors}, "call": call,
                              "features": features, "output": [[k, encode(v)] for k, v in out.items()]})
    # Defaults, and the all-empty batch transformers refuses.
    features = batch(rng)
    out = DataCollatorWithFlattening()(features)
    cases.append({"init": {}, "call": {}, "features": features,
                  "output": [[k, encode(v)] for k, v in out.items()]})
    errors = []
    for features in ([{"input_ids": []}], [{"input_ids": [], "labels": []}, {"input_ids": []}], []):
        try:
            DataCollatorWithFlattening()(features)
        except ValueError as exc:
            errors.append({"features": features, "error": str(exc)})
    OUT.write_text(json.dumps({"transformers": transformers.__version__, "cases": cases, "errors": errors},
                              separators=(",", ":")) + "\n")
    print(f"{len(cases)} cases, {len(errors)} errors -> {OUT}")


if __name__ == "__main__":
    main()
