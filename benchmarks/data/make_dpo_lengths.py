"""Token lengths of a real preference dataset, for bench_dpo.py --lengths.

Source: the 300 pairs of ``data/dpo_en_demo.json`` in LLaMA-Factory's sdist
(``pip download llamafactory==0.9.5 --no-deps --no-binary :all:``; multi-turn chat
preference pairs, sharegpt format). Tokenizer: the BPE ``tokenizer.json`` shipped in
``anthropic==0.30.0``'s wheel (a real 65k-entry BPE vocabulary: no tokenizer hub is
reachable from the machines this project runs on), read with ``tokenizers``.

Each pair's prompt is every turn of ``conversations`` (system, human and earlier
assistant turns), each turn's text tokenized on its own plus 4 tokens of chat
template per turn (role markers); ``chosen`` and ``rejected`` are the two replies'
texts plus 4. No text is stored: only the three counts per pair, in file order.

    python benchmarks/data/make_dpo_lengths.py DPO_EN_DEMO_JSON TOKENIZER_JSON > benchmarks/data/dpo_en_demo_lengths.csv
"""

from __future__ import annotations

import json
import sys

TEMPLATE_TOKENS = 4  # per turn: a role marker and separators, as chat templates add


def main(data_path: str, tokenizer_path: str) -> int:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids) + TEMPLATE_TOKENS

    pairs = json.load(open(data_path, encoding="utf-8"))
    print("prompt_tokens,chosen_tokens,rejected_tokens")
    for pair in pairs:
        prompt = sum(count(turn["value"]) for turn in pair["conversations"])
        print(f"{prompt},{count(pair['chosen']['value'])},{count(pair['rejected']['value'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:3]))
