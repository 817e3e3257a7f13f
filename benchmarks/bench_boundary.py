"""The cost of the checked tensor boundary: tensors cross into C++ as DLPack capsules.

Two tables, both from one run on the CPU:
1. What exporting one tensor costs: ``data_ptr()`` (the old raw address, unchecked),
   ``torch.utils.dlpack.to_dlpack`` (what seqpack passes) and ``Tensor.__dlpack__``
   with its device query (what the binding does for any other object).
2. Small calls where a fixed cost would show: the extension's log-prob row kernel on
   one row, ``pack_sequences`` / ``unpack`` of a tiny batch, ``seqpack.token_logprobs``
   on packed rows (its dispatch included) forward and forward+backward. Run the script once per build to compare builds
   (e.g. ``PYTHONPATH=<older install> python benchmarks/bench_boundary.py``); the
   build is named in the environment line.
"""

from __future__ import annotations

import argparse
import os
import sys
import timeit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import seqpack  # noqa: E402
from _harness import CsvLog, announce, environment, format_table  # noqa: E402


def per_call_us(fn, number: int, repeat: int = 7) -> float:
    """Best of ``repeat`` runs of ``number`` calls, in microseconds per call."""
    fn()
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def export_costs(n: int):
    from torch.utils.dlpack import to_dlpack

    x = torch.randn(4, 8)
    return [["data_ptr() (address only)", per_call_us(lambda: x.data_ptr(), n)],
            ["to_dlpack(x) (what seqpack passes)", per_call_us(lambda: to_dlpack(x), n)],
            ["x.__dlpack_device__() + x.__dlpack__()", per_call_us(lambda: (x.__dlpack_device__(), x.__dlpack__()), n)]]


def small_calls(n: int):
    torch.manual_seed(0)
    rows = []
    ids = torch.randint(0, 100, (4, 16))
    lens = [16, 9, 3, 12]
    rows.append(["pack_sequences [4, 16] int64",
                 per_call_us(lambda: seqpack.pack_sequences(ids, seq_lens=lens, pad_multiple=4), n)])
    packed = seqpack.pack_sequences(ids, seq_lens=lens, pad_multiple=4)
    y = packed["input"]
    rows.append(["PackedBatch.unpack [T] int64", per_call_us(lambda: packed.unpack(y), n)])
    logits = torch.randn(64, 128)
    tokens = torch.randint(0, 128, (64,))
    cu = [0, 20, 41, 64]
    rows.append(["token_logprobs [64, 128] fwd",
                 per_call_us(lambda: seqpack.token_logprobs(logits, cu, tokens), n)])
    leaf = logits.clone().requires_grad_()

    def fwd_bwd():
        seqpack.token_logprobs(leaf, cu, tokens).logprobs.sum().backward()

    rows.append(["token_logprobs [64, 128] fwd+bwd", per_call_us(fwd_bwd, max(n // 4, 1))])
    kernel = getattr(seqpack._core, "logprob_row_stats")
    one, target, out = torch.randn(1, 8), torch.zeros(1, dtype=torch.int64), torch.zeros(4, 1)
    try:  # the DLPack signature (this build)
        from torch.utils.dlpack import to_dlpack

        def call():
            kernel(to_dlpack(one), to_dlpack(target), 0, 1.0, to_dlpack(out[0]), to_dlpack(out[1]),
                   to_dlpack(out[3]), to_dlpack(out[2]), 1)

        call()
    except TypeError:  # a build with the raw-pointer signature
        def call():
            kernel(one.data_ptr(), 1, 8, 8, "float32", target.data_ptr(), 0, 1.0, out[0].data_ptr(),
                   out[1].data_ptr(), out[3].data_ptr(), out[2].data_ptr(), 1)
    rows.append(["_core.logprob_row_stats [1, 8] (6 tensors)", per_call_us(call, n)])
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--csv")
    args = parser.parse_args()
    n = 2000 if args.quick else 20000
    env = environment()
    env["seqpack"] = os.path.dirname(seqpack.__file__)
    announce(env, torch)
    torch.set_num_threads(1)
    log = CsvLog("boundary", env, args.csv)
    exports = export_costs(n * 10)
    calls = small_calls(n)
    for case, us in exports:
        log.add(case, "export", "us_per_call", us)
    for case, us in calls:
        log.add(case, "call", "us_per_call", us)
    print(format_table("Exporting one CPU tensor to C++ (us per call, best of 7)", ["how", "us"],
                       [[c, f"{v:.2f}"] for c, v in exports]))
    print(format_table("Small calls through the boundary (us per call, best of 7, 1 torch thread)", ["call", "us"],
                       [[c, f"{v:.1f}"] for c, v in calls]))
    print(f"\nCSV: {log.write()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
