"""A VLM GRPO batch on a prefix tree (issue 53): padded rows vs packed rows vs the tree.

A Qwen2-VL (transformers, fp32 on the CPU) on G responses per prompt, each prompt an
image and text: forward + backward of the rows' summed next-token NLL with the vision
tower encoding the images, on

* padded rows: ``model(**batch)`` as the processor holds the batch (every row
  encodes its prompt's image: G times);
* packed rows: the rows back to back, no padding, nothing shared
  (``PrefixTreeBatch.from_padded(..., group_ids=rows)``: each row its own tree, its
  image encoded with it, G times);
* the tree: ``hf.tree_kwargs(tree, model=, pixel_values=, ...)`` on the rows keyed by
  their images (``hf_vlm.image_keys``): each prompt, its image included, once.

The logits at every logical token and every gradient are compared with the padded
rows' before anything is timed; alternating, best of the runs.

    python benchmarks/bench_vlm_tree.py            # G = 8, images of 16 x 16 and 24 x 24 patches
    python benchmarks/bench_vlm_tree.py --quick    # one small case (a smoke test)
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import alternating, format_table, torch_start  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

TITLE = "VLM GRPO batch (Qwen2-VL), padded rows vs packed rows vs the prefix tree"


def model_of(quick: bool):
    from seqpack.integrations import hf
    from seqpack.testing.tiny_vlm import tiny_vlm

    size = dict(hidden=64, layers=2, vision_hidden=32, vision_layers=2) if quick else \
        dict(hidden=256, layers=4, vision_hidden=128, vision_layers=4)
    return tiny_vlm("qwen2_vl", attn_implementation=hf.register_tree(), **size)


def nll(logits, ids):
    """The summed next-token NLL of rows laid out ``logits`` [N, V] / ``ids`` [N]
    (each row's last token predicts nothing: masked by the caller)."""
    return -torch.log_softmax(logits.float(), -1).gather(-1, ids[:, None])[:, 0]


def padded_step(model, batch):
    out = model(**batch)
    mask = batch["attention_mask"]
    ids = batch["input_ids"]
    lp = -nll(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]), ids[:, 1:].reshape(-1)).view(ids.shape[0], -1)
    loss = -(lp * mask[:, 1:]).sum()
    loss.backward()
    return out.logits.detach()[mask.bool()]


def tree_step(model, batch, tree):
    import seqpack
    from seqpack.integrations import hf

    mm = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask")}
    kwargs = hf.tree_kwargs(tree, model=model, attention_mask=batch["attention_mask"], **mm)
    out = model(**kwargs)
    loss = -seqpack.token_logprobs(out.logits[0].float(), tree).logprobs.sum()
    loss.backward()
    return out.logits.detach()[0, torch.from_numpy(tree.logical_index.copy())], kwargs["pixel_values"].shape[0]


def main() -> int:
    import transformers

    args, log = torch_start(__doc__, "vlm_tree", transformers)

    import seqpack
    from seqpack.frameworks import hf_vlm
    from seqpack.testing.tiny_vlm import vlm_grpo_batch

    model = model_of(args.quick)
    # (G, each prompt's image (h, w) in patches, text tokens, completion max)
    cases = [(4, [(4, 4), (4, 6)], 8, 8)] if args.quick else \
        [(8, [(16, 16), (16, 16)], 128, 64), (8, [(24, 24), (16, 16)], 128, 64)]
    out_rows = []
    for g, images, text, completion in cases:
        batch = vlm_grpo_batch([[im] for im in images], g, text=text, completion=(completion // 2, completion),
                               seed=1)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        mm = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask")}
        keys = hf_vlm.image_keys(model, ids, mask, **mm)
        tree = seqpack.PrefixTreeBatch.from_padded(ids, mask, keys=keys)
        packed = seqpack.PrefixTreeBatch.from_padded(ids, mask, keys=keys, group_ids=np.arange(ids.shape[0]))

        def grads():
            return [p.grad.clone() for p in model.parameters() if p.grad is not None]

        model.zero_grad(set_to_none=True)
        want_logits = padded_step(model, batch)
        want = grads()
        checks = {}
        for name, layout in (("packed", packed), ("tree", tree)):
            model.zero_grad(set_to_none=True)
            logits, patches = tree_step(model, batch, layout)
            got = grads()
            checks[name] = (float((logits - want_logits).abs().max() / want_logits.abs().max()),
                            max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)) for a, b in zip(got, want)),
                            patches)

        def run_padded():
            model.zero_grad(set_to_none=True)
            padded_step(model, batch)

        def run_packed():
            model.zero_grad(set_to_none=True)
            tree_step(model, batch, packed)

        def run_tree():
            model.zero_grad(set_to_none=True)
            tree_step(model, batch, tree)

        t_pad, t_packed, t_tree = alternating([run_padded, run_packed, run_tree], 1 if args.quick else args.repeat)
        name = f"G={g} images {' + '.join(f'{h}x{w}' for h, w in images)} text {text} completion <= {completion}"
        logit_diff = max(checks["packed"][0], checks["tree"][0])
        grad_diff = max(checks["packed"][1], checks["tree"][1])
        out_rows.append([name, int(ids.numel()), packed.num_tokens, tree.num_tokens, int(batch["pixel_values"].shape[0]),
                         checks["tree"][2], t_pad * 1e3, t_packed * 1e3, t_tree * 1e3, t_pad / t_tree,
                         t_packed / t_tree, f"{logit_diff:.1e}", f"{grad_diff:.1e}"])
        for key, value in (("padded_tokens", ids.numel()), ("packed_tokens", packed.num_tokens),
                           ("tree_tokens", tree.num_tokens), ("patches_rows", batch["pixel_values"].shape[0]),
                           ("patches_tree", checks["tree"][2]), ("logit_rel_diff", logit_diff),
                           ("grad_rel_diff", grad_diff)):
            log.add(name, "-", key, value)
        for path, t in (("padded", t_pad), ("packed", t_packed), ("tree", t_tree)):
            log.add(name, path, "seconds_min", t)
        print(f"  {name}: done", flush=True)
    text_cfg, vision_cfg = model.config.text_config, model.config.vision_config
    print(format_table(
        TITLE, ["case", "padded tok", "packed tok", "tree tok", "patches (rows)", "patches (tree)", "padded ms",
                "packed ms", "tree ms", "tree vs padded", "tree vs packed", "logit rel diff", "grad rel diff"],
        out_rows,
        note="CPU fp32, torch threads = %d, Qwen2-VL text %d layers hidden %d, vision %d blocks width %d (patch 2, "
             "merge 2: 4 patches per placeholder token); 2 prompts x G responses, each prompt one image; forward + "
             "backward of the rows' next-token NLL, the vision tower included; best of %d, alternating. Packed rows "
             "and padded rows encode every row's image; the tree each prompt's once. Diffs: the largest relative "
             "difference of the packed / tree logits at the rows' tokens and of a parameter's gradient, against the "
             "padded rows." % (args.threads, text_cfg.num_hidden_layers, text_cfg.hidden_size, vision_cfg.depth,
                                vision_cfg.embed_dim, 1 if args.quick else args.repeat)))
    print(f"csv: {log.write()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
