"""FSDP2 worker for test_moe_fsdp2.py: ``python moe_fsdp_worker.py RANK WORLD PORT OUTDIR``.

Each rank builds the same tiny FP8 Qwen3-MoE (5 experts: the expert dimension splits
unevenly over 2 ranks), shards every decoder layer and the model with ``fully_shard`` (gloo,
CPU), trains a few steps with ``AdamWFp8`` on the same batches as a single-process run and
writes, per variant, the losses, the full parameters after training, and how the FP8 expert
tensors were sharded. Variants:

* ``fp8_coat`` / ``fp8_plain``: ``Fp8Config()`` — attention and experts FP8 and frozen
  (codes and scales are sharded like any parameter, never updated); the norms, router,
  embeddings and head train, with and without COAT's dynamic range expansion.
* ``hp_experts``: ``Fp8Config(modules_to_not_convert=["experts"])`` — the experts stay
  high precision and train: ``AdamWFp8`` keeps FP8 moments of the sharded 3-D parameters.
* ``fp8_split``: as ``fp8_coat``, each FP8 module in its own group
  (``hf_fp8.fsdp.fully_shard_fp8``): the same numbers.
* ``fp8_bf16``: ``fp8_split`` with ``MixedPrecisionPolicy(param_dtype=bfloat16)`` on the
  layers and the model: codes stay fp8, the rest computes in bf16.

``no_helper_error``: the same bf16 policy on the layers without ``fully_shard_fp8`` (FSDP2
casts the fp8 codes to bf16; ``Fp8Experts`` refuses them).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import transformers as tf
from torch import nn

from hf_fp8 import Fp8Config, quantize_model
from hf_fp8.optim import AdamWFp8

VARIANTS = ("fp8_coat", "fp8_plain", "hp_experts", "fp8_split", "fp8_bf16")
STEPS = 3
NUM_EXPERTS = 5
VOCAB = 128


def build_model(variant: str) -> nn.Module:
    """The tiny Qwen3-MoE of ``variant``, quantized with ``quantize_model`` (fp32 otherwise)."""
    torch.manual_seed(0)
    cfg = tf.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    model = tf.Qwen3MoeForCausalLM(cfg)
    skip = ["experts"] if variant == "hp_experts" else []
    return quantize_model(model, Fp8Config(modules_to_not_convert=skip), skip=["lm_head"])


def make_optimizer(model: nn.Module, variant: str) -> AdamWFp8:
    """AdamWFp8 over the trainable parameters (the FP8 codes and scales are frozen)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return AdamWFp8(
        params,
        lr=1e-2,
        weight_decay=0.01,
        dynamic_range_expansion=variant != "fp8_plain",
        min_quantize_numel=256,  # the router [5, 64] and the experts get FP8 moments too
    )


def batch() -> torch.Tensor:
    """The one batch every step trains on (the same on every rank)."""
    return torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(100))


def train_steps(model: nn.Module, opt: torch.optim.Optimizer) -> list[float]:
    losses = []
    ids = batch()
    for _ in range(STEPS):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor shard (fp8 gathered as bytes: gloo has no fp8 type)."""
    if not hasattr(t, "full_tensor"):
        return t.detach().clone()
    if t.element_size() == 1 and t.is_floating_point():
        return full_tensor(t.detach().view(torch.uint8)).view(t.dtype)
    return t.detach().full_tensor().clone()


def sharded(variant: str, *, helper: bool = True) -> tuple[nn.Module, AdamWFp8]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from hf_fp8.fsdp import fully_shard_fp8

    model = build_model(variant)
    mp = MixedPrecisionPolicy()
    if variant == "fp8_bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if variant in ("fp8_split", "fp8_bf16") and helper:
        fully_shard_fp8(model)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model, make_optimizer(model, variant)


def no_helper_error() -> str | None:
    """The error of one step under the bf16 policy without ``fully_shard_fp8``."""
    model, opt = sharded("fp8_bf16", helper=False)
    try:
        train_steps(model, opt)
    except (TypeError, ValueError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def run_variant(variant: str) -> dict:
    model, opt = sharded(variant)
    experts = model.model.layers[0].mlp.experts
    shards = {
        name: {
            "placements": [str(p) for p in t.placements],
            "local_shape": tuple(t.to_local().shape),
            "dtype": str(t.dtype),
        }
        for name, t in experts.named_parameters()
    }
    losses = train_steps(model, opt)
    params = {name: full_tensor(p) for name, p in model.named_parameters()}
    states = sorted(
        {f"{type(v).__name__}:{v.dtype}" for st in opt.state.values() for v in st.values()}
    )
    return {"losses": losses, "params": params, "shards": shards, "states": states}


def main(rank: int, world: int, port: int, outdir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=90))
    try:
        result = {variant: run_variant(variant) for variant in VARIANTS}
        result["no_helper_error"] = no_helper_error()
        if rank == 0:
            torch.save(result, os.path.join(outdir, "result.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    # skip interpreter finalization: there, a gloo run-loop thread of torch that touches
    # Python is ended by pthread_exit through noexcept C++ frames ("terminate called without
    # an active exception", about 1 run in 15 on 2 busy cores; a torch/gloo shutdown race)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
