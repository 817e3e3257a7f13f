"""verl 0.9.1's own FSDP engine (``FSDPEngineWithLMHead``) on the CPU, stock and
under ``seqpack.frameworks.verl.engine.patch(shared_prefix=True)`` (and with
``prefix_reuse=True`` under a cap smaller than the trees), on one GRPO batch
made the way verl's trainer makes it (``left_right_2_no_padding``). Run by
test_verl_engine.py in a process of its own: verl has no CPU platform, so one is
registered before verl is imported (a test-only stand-in, as a hardware vendor's
plugin registers its own), the engine class is registered for it, gloo with one
rank, fp32 parameters and compute. Prints one JSON line."""

import json
import os
import sys
import tempfile
from contextlib import nullcontext

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry, set_platform


@PlatformRegistry.register(platform="cpu")
class CpuPlatform(PlatformBase):
    device_name = property(lambda self: "cpu")
    vendor_name = property(lambda self: "cpu")
    device_module = property(lambda self: torch.cpu)

    def is_available(self): return True
    def current_device(self): return "cpu"
    def device_count(self): return 1
    def set_device(self, i): pass
    def synchronize(self, i=None): pass
    def manual_seed(self, s): torch.manual_seed(s)
    def manual_seed_all(self, s): torch.manual_seed(s)
    def set_allocator_settings(self, s): pass
    def empty_cache(self): pass
    def get_device_capability(self, i=0): return None, None
    def communication_backend_name(self): return "gloo"
    def visible_devices_envvar(self): return "CUDA_VISIBLE_DEVICES"
    def nvtx_range(self, msg): return nullcontext()
    def profiler_start(self): pass
    def profiler_stop(self): pass
    def ray_resource_name(self): return "CPU"
    def ray_noset_envvars(self): return []
    def is_ipc_supported(self): return False
    def cudart(self): return None


set_platform(CpuPlatform())

import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
import verl.models.transformers.monkey_patch as monkey_patch  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.config import CheckpointConfig  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import ActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig  # noqa: E402
from verl.workers.engine import EngineRegistry  # noqa: E402
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402

from seqpack.frameworks.verl import engine as seqpack_engine  # noqa: E402

monkey_patch.is_trl_available = lambda: False  # TRL 1.16 has no AutoModelForCausalLMWithValueHead (verl's check)


@EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device="cpu")
class CpuEngine(FSDPEngineWithLMHead):
    pass


def batch(seed=0, prompts=3, g=4, p=10, r=6):
    """GRPO rows: each prompt (left-padded) G times, responses right-padded."""
    gen = torch.Generator().manual_seed(seed)
    rows = prompts * g
    pr = torch.zeros(rows, p, dtype=torch.long)
    pm = torch.zeros(rows, p, dtype=torch.long)
    for k in range(prompts):
        n = p - k  # k left pads
        pr[k * g:(k + 1) * g, p - n:] = torch.randint(3, 120, (n,), generator=gen)
        pm[k * g:(k + 1) * g, p - n:] = 1
    rl = torch.randint(1, r + 1, (rows,), generator=gen)
    rm = (torch.arange(r)[None] < rl[:, None]).long()
    rs = torch.randint(3, 120, (rows, r), generator=gen) * rm
    am = torch.cat([pm, rm], 1)
    tensors = dict(prompts=pr, responses=rs, input_ids=torch.cat([pr, rs], 1), attention_mask=am,
                   position_ids=(am.cumsum(1) - 1).clamp(min=0), response_mask=rm,
                   old_log_probs=-torch.rand(rows, r, generator=gen), advantages=torch.randn(rows, r, generator=gen))
    uid = [f"u{k}" for k in range(prompts) for _ in range(g)]
    import numpy as np

    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": np.array(uid, dtype=object)},
                               meta_info={"temperature": 0.8})


def engine(path):
    fp32 = dict(param_dtype="fp32", reduce_dtype="fp32", buffer_dtype="fp32")
    eng = EngineRegistry.new(
        "language_model", "fsdp2",
        model_config=HFModelConfig(path=path, load_tokenizer=False, use_remove_padding=True,
                                   override_config={"attn_implementation": "sdpa"}),
        engine_config=FSDPEngineConfig(strategy="fsdp2", use_dynamic_bsz=True, max_token_len_per_gpu=48,
                                       infer_max_token_len_per_gpu=48, param_offload=False, optimizer_offload=False,
                                       use_torch_compile=False, mixed_precision=fp32),
        optimizer_config=FSDPOptimizerConfig(lr=1e-3, total_training_steps=10), checkpoint_config=CheckpointConfig())
    eng.initialize()
    return eng


def run(path, patched, prefix_reuse=False, cap=48):
    if patched:
        seqpack_engine.patch(shared_prefix=True, prefix_reuse=prefix_reuse)
    eng = engine(path)
    data = batch()
    td = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(td, use_remove_padding=True, use_dynamic_bsz=True, max_token_len_per_gpu=cap,
                         calculate_entropy=True, compute_loss=False)
    with eng.eval_mode():
        out = eng.infer_batch(td, loss_function=None)
    lp = no_padding_2_padding(out["model_output"]["log_probs"], td).float()
    ent = no_padding_2_padding(out["model_output"]["entropy"], td).float()
    td = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(td, use_remove_padding=True, use_dynamic_bsz=True, max_token_len_per_gpu=cap,
                         calculate_entropy=True, global_batch_size=len(td))
    actor = ActorConfig(strategy="fsdp2", rollout_n=4, ppo_micro_batch_size_per_gpu=-1, ppo_mini_batch_size=12,
                        use_dynamic_bsz=True, ppo_max_token_len_per_gpu=48)
    from functools import partial

    with eng.train_mode():
        trained = eng.train_batch(td, loss_function=partial(ppo_loss, config=actor))
    mask = data.batch["response_mask"].bool()
    return dict(log_probs=lp[mask].tolist(), entropy=ent[mask].tolist(), loss=float(sum(trained["loss"])),
                grad_norm=float(trained["metrics"]["grad_norm"]), counts=seqpack_engine.counts(reset=True),
                patched=seqpack_engine.patched_names())


def main():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    path = tempfile.mkdtemp(prefix="seqpack-verl-engine-")
    cfg = transformers.Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=128, max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(path)
    stock = run(path, False)
    tree = run(path, True)
    # a cap of 12 below rows of up to 16 tokens and trees of up to 34: passes, prefixes once a step
    reuse = run(path, True, prefix_reuse=True, cap=12)
    print(json.dumps({"stock": stock, "tree": tree, "reuse": reuse}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
