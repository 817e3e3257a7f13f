"""TRL 1.16's GRPO log-probs recorded (``data/trl_grpo_cases.json``, made by
``data/make_trl_grpo_cases.py``) and replayed on prefix trees without TRL: the tiny
Llama of the recording (NumPy weights) on each batch's tree, its LM head only at the
tokens that predict a completion token, gives TRL's ``[B, C]`` log-probs and
entropies (fp32) - the computation ``patch(shared_prefix=True)`` puts in TRL's place."""

import importlib.util
import json
import pathlib

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from seqpack.frameworks._completion_trees import completion_logprobs  # noqa: E402
from seqpack.integrations import hf  # noqa: E402

DATA = pathlib.Path(__file__).parent / "data"
RECORD = json.loads((DATA / "trl_grpo_cases.json").read_text())


def recorder():
    spec = importlib.util.spec_from_file_location("make_trl_grpo_cases", DATA / "make_trl_grpo_cases.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("case", RECORD["cases"], ids=lambda c: f"B{len(c['input_ids'])}-C{c['logits_to_keep']}")
def test_recorded_trl_grpo_log_probs_on_trees(case):
    model = recorder().model()
    hf.use_tree_attention(model)
    ids, mask = torch.tensor(case["input_ids"]), torch.tensor(case["attention_mask"])
    with torch.no_grad():
        lp, ent = completion_logprobs(model, ids, mask, case["logits_to_keep"], temperature=case["temperature"],
                                      return_entropy=True)
    want_lp, want_ent = torch.tensor(case["log_probs"]), torch.tensor(case["entropy"])
    real = mask[:, -case["logits_to_keep"]:].bool()
    torch.testing.assert_close(lp, want_lp, rtol=2e-4, atol=2e-5)
    torch.testing.assert_close(ent[real], want_ent[real], rtol=2e-4, atol=2e-5)
    assert (lp[~real] == 0).all() and np.isclose(RECORD["config"]["vocab_size"], model.config.vocab_size)
