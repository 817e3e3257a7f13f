"""THD pack/unpack benchmark (SPEC P3): seqpack vs a per-sequence PyTorch loop and memcpy.

Same process, same data. Baselines:
  loop    a per-sequence slicing loop like ROLL's ``_pack_sequences`` (slice each row's
          real tokens, pad, with CP pick the rank's two chunks, ``torch.cat``), and the
          matching ``_unpack`` loop writing each sequence back into a padded tensor;
  memcpy  ``dst.copy_(src)`` of exactly the bytes the packed tensor holds: the
          physical limit of a copy on this machine (its source stays in the cache
          between runs; "memcpy cold" reads a source out of the cache instead);
  clone   allocate + copy, as every fresh output does.
Lengths are RL-like long-tail (seqpack.tools.report.synthetic_rl_lengths clipped to S).

    python benchmarks/bench_thd.py            # full run
    python benchmarks/bench_thd.py --quick    # small shapes, smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

# Transparent huge pages for PyTorch's CPU allocations of 2 MiB and more (its own
# switch, read once at start-up): with 4 KiB pages, first-touching a fresh 1 GiB
# output costs ~5x the copy itself here, but on tensors of a few MiB the 2 MiB
# aligned allocations cost more than they save. So every case runs in its own
# process, with THP for the cases of 64 MiB and more; both sides of a row run
# under the same setting. --no-thp measures everything without.
THP_FROM_BYTES = 64 << 20

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import CsvLog, announce, environment, format_table, measure  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import seqpack  # noqa: E402
from seqpack.tools.report import synthetic_rl_lengths  # noqa: E402


def loop_pack(x, lens, multiple, cp, rank, pad):
    out = []
    for b, n in enumerate(lens):
        length = -(-n // multiple) * multiple
        seq = x[b, :n]
        if length > n:
            seq = torch.cat([seq, seq.new_full((length - n, *x.shape[2:]), pad)])
        if cp == 1:
            out.append(seq)
        else:
            chunks = seq.chunk(2 * cp)
            out.extend([chunks[rank], chunks[2 * cp - 1 - rank]])
    return torch.cat(out)


def loop_unpack(y, lens, padded, width, cp, rank):
    out = y.new_zeros((len(lens), width, *y.shape[1:]))
    offset = 0
    for b, (n, length) in enumerate(zip(lens, padded)):
        if cp == 1:
            out[b, :n] = y[offset:offset + n]
            offset += length
            continue
        chunk = length // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            lo, hi = c * chunk, min((c + 1) * chunk, n)
            if hi > lo:
                out[b, lo:hi] = y[offset:offset + hi - lo]
            offset += chunk
    return out


def cold_copy_seconds(dst, repeat):
    """Best time of ``dst.copy_(src)`` with ``src`` out of the cache: successive
    slices of a 512 MiB pool (at least 4x the bytes), as pack reads its padded
    input when that is larger than L3."""
    n = dst.numel()
    pool = torch.ones(max((512 << 20) // dst.element_size(), 4 * n), dtype=dst.dtype)
    slots = pool.numel() // n
    turn = iter(range(10**9))
    return measure(lambda: dst.copy_(pool[(next(turn) % slots) * n:][:n]), repeat=repeat)["min"]


def case_lengths(batch, width, seed=0):
    return np.minimum(synthetic_rl_lengths(batch, seed=seed, max_len=width), width).astype(np.int64)


def bench_case(name, x, lens, cp, log, rows, targets, threads):
    multiple = seqpack.alignment(cp_size=cp)
    lens_list = lens.tolist()
    packed = seqpack.pack_sequences(x, seq_lens=lens, pad_multiple=multiple, cp_size=cp, cp_rank=0,
                                    num_threads=threads)
    y = packed["input"]
    ref = loop_pack(x, lens_list, multiple, cp, 0, 0)
    assert torch.equal(y, ref), name
    padded = packed.padded_lens.tolist()
    back = packed.unpack(y)
    assert torch.equal(back, loop_unpack(y, lens_list, padded, x.shape[1], cp, 0)), name
    nbytes = y.numel() * y.element_size()
    src = x.reshape(-1)[: y.numel()]
    dst = torch.empty_like(y).reshape(-1)
    # Small cases are noisy on a shared VM: more runs (each takes well under 1 ms).
    repeat = 9 if nbytes >= THP_FROM_BYTES else 60
    t_copy = measure(lambda: dst.copy_(src), repeat=repeat)["min"]
    t_copy_cold = cold_copy_seconds(dst, repeat)
    t_clone = measure(lambda: src.clone(), repeat=repeat)["min"]
    t_pack = measure(lambda: seqpack.pack_sequences(x, seq_lens=lens, pad_multiple=multiple, cp_size=cp,
                                                    num_threads=threads), repeat=repeat)["min"]
    # The copy kernel alone: the plan's pack into a preallocated output (no planning,
    # allocation or metadata): the bandwidth pack reaches.
    plan, kernel_out = packed._plan, torch.empty_like(y)
    row_bytes = y[:1].numel() * y.element_size()
    t_kernel = measure(lambda: plan.pack_into(x, kernel_out, bytes(row_bytes), threads), repeat=repeat)["min"]
    assert torch.equal(kernel_out, y), name
    t_loop = measure(lambda: loop_pack(x, lens_list, multiple, cp, 0, 0), repeat=5, budget_s=20)["min"]
    t_unpack = measure(lambda: packed.unpack(y), repeat=repeat)["min"]
    t_loop_unpack = measure(lambda: loop_unpack(y, lens_list, padded, x.shape[1], cp, 0), repeat=5,
                            budget_s=20)["min"]
    # unpack also writes the padded output's fill: compare with a copy of its bytes too.
    out_bytes = back.numel() * back.element_size()
    big_src = torch.empty(out_bytes, dtype=torch.uint8)
    big_dst = torch.empty_like(big_src)
    t_copy_out = measure(lambda: big_dst.copy_(big_src), repeat=repeat)["min"]
    t_clone_out = measure(lambda: big_src.clone(), repeat=repeat)["min"]
    case = f"{name}/cp={cp}"
    for impl, t in (("memcpy", t_copy), ("memcpy_cold", t_copy_cold), ("clone", t_clone), ("seqpack_pack", t_pack), ("seqpack_pack_kernel", t_kernel),
                    ("loop_pack", t_loop),
                    ("seqpack_unpack", t_unpack), ("loop_unpack", t_loop_unpack), ("memcpy_unpacked", t_copy_out),
                    ("clone_unpacked", t_clone_out)):
        log.add(case, impl, "seconds", t)
    log.add(case, "-", "packed_bytes", nbytes)
    rows.append([name, cp, f"{nbytes / 2**20:,.1f}", t_copy * 1e3, t_copy_cold * 1e3, t_clone * 1e3, t_kernel * 1e3,
                 t_copy / t_kernel, t_pack * 1e3, t_loop * 1e3, t_loop / t_pack, t_copy / t_pack, t_copy_cold / t_pack,
                 t_clone / t_pack, t_unpack * 1e3, t_loop_unpack * 1e3,
                 t_loop_unpack / t_unpack, t_copy_out / t_unpack, t_clone_out / t_unpack])
    targets[case] = {"kernel_of_memcpy": t_copy / t_kernel, "vs_loop": t_loop / t_pack, "of_memcpy": t_copy / t_pack, "of_memcpy_cold": t_copy_cold / t_pack,
                     "of_clone": t_clone / t_pack,
                     "unpack_vs_loop": t_loop_unpack / t_unpack, "unpack_of_memcpy": t_copy_out / t_unpack}


SHAPES = {  # name: ((B, S), hidden, dtype)
    "ids[256,8192] int64": ((256, 8192), (), torch.int64),
    "ids[1024,4096] int64": ((1024, 4096), (), torch.int64),
    "hidden[64,4096,4096] bf16": ((64, 4096), (4096,), torch.bfloat16),
}
QUICK_SHAPES = {
    "ids[64,1024] int64": ((64, 1024), (), torch.int64),
    "hidden[8,512,256] bf16": ((8, 512), (256,), torch.bfloat16),
}


def run_shape(name, spec, threads):
    """Both CP settings of one shape in this process; returns (csv rows, table rows, targets)."""
    (batch, width), hidden, dtype = spec
    log = CsvLog("thd", {})
    rows, targets = [], {}
    lens = case_lengths(batch, width)
    if dtype.is_floating_point:
        x = torch.empty((batch, width, *hidden), dtype=dtype).normal_()
    else:
        x = torch.randint(0, 150000, (batch, width, *hidden), dtype=dtype)
    for cp in (1, 2):
        bench_case(name, x, lens, cp, log, rows, targets, threads)
    return log.rows, rows, targets


def shape_bytes(spec) -> int:
    (batch, width), hidden, dtype = spec
    return batch * width * int(np.prod(hidden, dtype=np.int64)) * dtype.itemsize


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=0, help="seqpack CPU threads (0: automatic)")
    parser.add_argument("--csv")
    parser.add_argument("--no-thp", action="store_true", help="never set THP_MEM_ALLOC_ENABLE")
    parser.add_argument("--shape", help=argparse.SUPPRESS)  # internal: one shape, JSON out
    args = parser.parse_args()
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.shape:
        print(json.dumps(run_shape(args.shape, shapes[args.shape], args.threads)))
        return 0
    env = environment()
    env["thp_mem_alloc"] = "never" if args.no_thp else f"cases of >= {THP_FROM_BYTES >> 20} MiB"
    announce(env, torch)
    log = CsvLog("thd", env, args.csv)
    rows, targets = [], {}
    for name, spec in shapes.items():
        child_env = dict(os.environ)
        child_env.pop("THP_MEM_ALLOC_ENABLE", None)
        if not args.no_thp and shape_bytes(spec) >= THP_FROM_BYTES:
            child_env["THP_MEM_ALLOC_ENABLE"] = "1"
        cmd = [sys.executable, os.path.abspath(__file__), "--shape", name, "--threads", str(args.threads)]
        cmd += ["--quick"] if args.quick else []
        out = subprocess.run(cmd, env=child_env, check=True, capture_output=True, text=True).stdout
        csv_rows, shape_rows, shape_targets = json.loads(out.strip().splitlines()[-1])
        log.rows.extend(csv_rows)
        rows.extend(shape_rows)
        targets.update(shape_targets)
        print(f"  {name}: done (THP {'on' if 'THP_MEM_ALLOC_ENABLE' in child_env else 'off'})", flush=True)
    print(format_table(
        "THD pack / unpack on the CPU: seqpack vs per-sequence loop vs memcpy (ms, best run)",
        ["tensor", "CP", "packed MiB", "memcpy", "memcpy cold", "clone", "kernel", "of memcpy", "pack", "loop pack",
         "x loop", "of memcpy", "of cold", "of clone",
         "unpack", "loop unpack", "x loop", "of memcpy", "of clone"], rows,
        note="memcpy: copy_ into a preallocated buffer (the bandwidth limit; its source stays in the cache); "
             "memcpy cold: the same from a source out of the cache, as pack reads its padded input; kernel: the "
             "plan's copies alone into a preallocated output; pack: the whole pack_sequences call; clone: allocate + copy, which pays "
             "first-touch page faults as every fresh output does. 'of X' = X time / seqpack time for the same "
             "bytes (pack: the packed bytes; unpack: the padded output's bytes). CP rows build rank 0's local THD. "
             f"THP_MEM_ALLOC_ENABLE: {env['thp_mem_alloc']}."))
    print(f"\nCSV: {log.write()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
