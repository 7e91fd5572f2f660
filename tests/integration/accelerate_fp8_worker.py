"""Worker for test_accelerate_fp8_mixed_precision.py:
``python accelerate_fp8_worker.py RANK WORLD PORT OUTDIR VARIANT [--manual | --single]``.

An unchanged accelerate training script: ``Accelerator(mixed_precision="bf16")`` with an FSDP2
plugin (``fsdp_version=2``, one decoder layer per group) prepares an FP8 model and its
optimizer together and trains a few steps. Variants:

* ``llama_lora``: a tiny Llama quantized with ``Fp8Config("dynamic")``, LoRA adapters
  (``peft.get_peft_model``) on ``q_proj`` / ``v_proj``: only the adapters train.
* ``moe_norms``: a tiny Qwen3-MoE quantized with ``Fp8Config()`` (attention and experts
  FP8), only the RMSNorm weights train.

Writes ``OUTDIR/VARIANT.pt`` (rank 0): losses, the trainable parameters before and after,
the dtype of every FP8 code after ``prepare`` and after training, and the dtypes of the FP8
codes the forward of each FP8 module actually received (or the error of the first step).
``--manual``: ``hf_fp8.fully_shard_fp8(model)`` before ``prepare`` (the route that needs no
patch). ``--single``: the same model, optimizer and batches in one process without accelerate or
FSDP, in fp32: the reference.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import transformers as tf
from torch import nn

STEPS = 3
VOCAB = 128
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def build_model(variant: str) -> nn.Module:
    """The tiny FP8 model of ``variant``, its trainable parameters chosen (fp32)."""
    from hf_fp8 import Fp8Config, quantize_model

    torch.manual_seed(0)
    if variant == "llama_lora":
        from peft import LoraConfig, get_peft_model

        from hf_fp8.utils.tiny import tiny_llama_config

        model = tf.LlamaForCausalLM(tiny_llama_config(64, 2, 32))
        model = quantize_model(model, Fp8Config("dynamic"), skip=["lm_head"])
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        model = get_peft_model(model, lora)
        for name, module in model.named_modules():  # LoRA B starts at 0: give it a value
            if name.endswith("lora_B.default"):
                nn.init.normal_(module.weight, std=0.02)
        return model
    if variant == "moe_norms":
        from tests.integration.moe_fsdp_worker import build_model as build_moe

        model = build_moe("fp8_coat")
        for name, param in model.named_parameters():
            param.requires_grad_(name.endswith("norm.weight"))
        return model
    raise ValueError(f"unknown variant {variant!r}")


def fp8_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from hf_fp8.fsdp import fp8_modules as modules

    found = {id(m) for m in modules(model)}
    return [(n, m) for n, m in model.named_modules() if id(m) in found]


def code_dtypes(model: nn.Module) -> dict[str, str]:
    """``{name: dtype}`` of every fp8-stored parameter of the FP8 modules."""
    return {
        f"{name}.{pname}": str(p.dtype)
        for name, module in fp8_modules(model)
        for pname, p in module.named_parameters(recurse=False)
        if not pname.endswith(("scale", "bias"))
    }


def record_forward_dtypes(model: nn.Module, seen: set[str]) -> None:
    """Record the dtypes of the FP8 modules' codes as their forward sees them."""

    def hook(module: nn.Module, args) -> None:
        for pname, p in module.named_parameters(recurse=False):
            if not pname.endswith(("scale", "bias")):
                seen.add(str(p.dtype))

    for _, module in fp8_modules(model):
        module.register_forward_pre_hook(hook)


def batch() -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(100))


def full(t: torch.Tensor) -> torch.Tensor:
    if hasattr(t, "full_tensor"):
        return t.detach().full_tensor().float().clone()
    return t.detach().float().clone()


def make_accelerator(single: bool):
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if single:
        return None
    # accelerate enables FSDP only on accelerator devices: gloo on CPU labelled multi-device,
    # as integrations/accelerate/train_fsdp2.py does
    PartialState(cpu=True, timeout=timedelta(seconds=90))
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        reshard_after_forward=True,
        state_dict_type="SHARDED_STATE_DICT",
    )
    return Accelerator(mixed_precision="bf16", fsdp_plugin=plugin)


def run(variant: str, single: bool, manual: bool = False) -> dict:
    accelerator = make_accelerator(single)
    model = build_model(variant)
    if manual:  # the patch's public alternative: the FP8 groups made before prepare
        from hf_fp8 import fully_shard_fp8

        fully_shard_fp8(model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    start = {n: full(p) for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    if accelerator is not None:
        model, optimizer = accelerator.prepare(model, optimizer)
    result: dict = {"prepared": code_dtypes(model), "trainable": trainable, "start": start}
    seen: set[str] = set()
    record_forward_dtypes(model, seen)
    losses, error = [], None
    ids = batch()
    model.train()
    try:
        for _ in range(STEPS):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward() if accelerator is None else accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
    except Exception as exc:  # recorded: what a user sees today
        error = f"{type(exc).__name__}: {exc}"
    result.update(losses=losses, error=error, forward_dtypes=sorted(seen))
    result["trained"] = code_dtypes(model)
    if error is None:
        result["params"] = {n: full(p) for n, p in model.named_parameters() if n in start}
    result["distributed_type"] = str(getattr(accelerator, "distributed_type", None))
    return result


def main(rank: int, world: int, port: int, outdir: str, variant: str, flag: str) -> None:
    single = flag == "--single"
    if not single:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
        )
    torch.set_num_threads(1)
    try:
        result = run(variant, single, manual=flag == "--manual")
        if rank == 0:
            name = variant + {"--single": "_single", "--manual": "_manual"}.get(flag, "")
            torch.save(result, os.path.join(outdir, f"{name}.pt"))
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    rank, world, port, outdir, variant = sys.argv[1:6]
    main(int(rank), int(world), int(port), outdir, variant, (sys.argv[6:] or [""])[0])
    sys.stdout.flush()  # no interpreter finalization: see tests/optim/fsdp_worker.py
    sys.stderr.flush()
    os._exit(0)
