"""An MoE GRPO batch on a prefix tree with the load-balancing loss on (issue 53): padded rows vs the tree.

A Qwen3-MoE (transformers, eager experts, fp32 on the CPU) with
``output_router_logits=True``: forward + backward of the summed next-token NLL of
every row plus ``router_aux_loss_coef`` x the load-balancing ``aux_loss``, on G
responses per prompt, padded rows (``attention_mask``) against the rows' prefix tree
(``model(**hf.tree_kwargs(tree))``: each prompt once, each prompt token counted once
per row in the aux loss). The aux loss and every gradient are compared before
anything is timed; alternating, best of the runs.

    python benchmarks/bench_moe_tree.py            # G = 8 and 16, prompts of 256 / 512 tokens
    python benchmarks/bench_moe_tree.py --quick    # one small case (a smoke test)
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import alternating, format_table, torch_start  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

TITLE = "MoE GRPO batch with the load-balancing loss, padded rows vs the prefix tree"


def model_of(quick: bool):
    import transformers

    from seqpack.integrations import hf

    size = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
                num_experts=4, vocab_size=512) if quick else \
        dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=4, num_experts=8,
             vocab_size=8192)
    cfg = transformers.Qwen3MoeConfig(num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                                      num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.01,
                                      max_position_embeddings=4096, tie_word_embeddings=False, **size)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=hf.register_tree(),
                                                         experts_implementation="eager")


def rows_of(g: int, prompt: int, completion: int, vocab: int, groups: int = 2, seed: int = 0):
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(groups):
        p = rng.integers(3, vocab, prompt).tolist()
        rows += [p + rng.integers(3, vocab, int(rng.integers(completion // 2, completion + 1))).tolist()
                 for _ in range(g)]
    return rows


def padded_step(model, ids, mask):
    out = model(input_ids=ids, attention_mask=mask)
    logp = torch.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    loss = -(logp * mask[:, 1:]).sum() + model.config.router_aux_loss_coef * out.aux_loss
    loss.backward()
    return out.aux_loss.detach()


def tree_step(model, rows):
    import seqpack
    from seqpack.integrations import hf

    tree = seqpack.pack_prefix_tree(rows)
    out = model(**hf.tree_kwargs(tree))
    lp = seqpack.token_logprobs(out.logits[0].float(), tree).logprobs
    loss = -lp.sum() + model.config.router_aux_loss_coef * out.aux_loss
    loss.backward()
    return out.aux_loss.detach(), tree


def main() -> int:
    import transformers

    args, log = torch_start(__doc__, "moe_tree", transformers)

    model = model_of(args.quick)
    vocab = model.config.vocab_size
    cases = [(4, 24, 8)] if args.quick else [(8, 256, 64), (16, 512, 64)]
    out_rows = []
    for g, prompt, completion in cases:
        rows = rows_of(g, prompt, completion, vocab)
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        mask = (torch.arange(width)[None] < torch.tensor([len(r) for r in rows])[:, None]).long()

        def grads():
            return [p.grad.clone() for p in model.parameters() if p.grad is not None]

        model.zero_grad(set_to_none=True)
        aux_rows = padded_step(model, ids, mask)
        want = grads()
        model.zero_grad(set_to_none=True)
        aux_tree, tree = tree_step(model, rows)
        got = grads()
        aux_diff = float((aux_tree - aux_rows).abs() / aux_rows.abs())
        grad_diff = max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)) for a, b in zip(got, want))

        def padded():
            model.zero_grad(set_to_none=True)
            padded_step(model, ids, mask)

        def on_tree():
            model.zero_grad(set_to_none=True)
            tree_step(model, rows)

        t_rows, t_tree = alternating([padded, on_tree], 1 if args.quick else args.repeat)
        name = f"G={g} prompt {prompt} completion <= {completion}"
        out_rows.append([name, int(ids.numel()), int(mask.sum()), tree.num_tokens, t_rows * 1e3, t_tree * 1e3,
                         t_rows / t_tree, f"{aux_diff:.1e}", f"{grad_diff:.1e}"])
        for key, value in (("padded_tokens", ids.numel()), ("real_tokens", int(mask.sum())),
                           ("tree_tokens", tree.num_tokens), ("aux_rel_diff", aux_diff), ("grad_rel_diff", grad_diff)):
            log.add(name, "-", key, value)
        log.add(name, "padded", "seconds_min", t_rows)
        log.add(name, "tree", "seconds_min", t_tree)
        print(f"  {name}: done", flush=True)
    print(format_table(
        TITLE, ["case", "padded tok", "real tok", "tree tok", "padded ms", "tree ms", "speed-up", "aux rel diff",
                "grad rel diff"], out_rows,
        note="CPU fp32, torch threads = %d, Qwen3-MoE %d layers hidden %d, %d experts (top 2), vocab %d, eager "
             "experts; 2 prompts x G responses; forward + backward of the rows' NLL + %.2f x aux_loss; best of %d, "
             "alternating. aux rel diff: the tree's aux_loss against the padded rows' (transformers sums it in "
             "fp32); grad rel diff: the largest relative difference of a parameter's gradient." % (
                 args.threads, model.config.num_hidden_layers, model.config.hidden_size, model.config.num_experts,
                 vocab, model.config.router_aux_loss_coef, 1 if args.quick else args.repeat)))
    print(f"csv: {log.write()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
