"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for models with FP8 layers.

FP8 codes and their scales are frozen parameters: FSDP2 shards them like any other (the
expert dimension of ``Fp8Experts`` on dim 0, ``Fp8Linear`` rows) and a training step leaves
them bit-identical; the high-precision parts (norms, routers, embeddings, LoRA adapters,
experts kept in high precision) train with any optimizer, ``AdamWFp8`` included. One thing
breaks: a ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` on a group holding FP8
modules casts their fp8 codes to bf16 at every all-gather (twice the bytes; ``Fp8Experts``
refuses the cast weights). :func:`fully_shard_fp8` shards every FP8 module in a group of its
own that keeps the stored dtypes; shard the layers and the model after it as usual::

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard_fp8(model, mesh=mesh)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hf_fp8.modules.fp8_experts import Fp8Experts
from hf_fp8.modules.fp8_linear import Fp8Linear


def fp8_modules(model: nn.Module) -> list[nn.Module]:
    """Every ``Fp8Linear`` / ``Fp8Experts`` of ``model`` (once each), in module order."""
    return [m for m in model.modules() if isinstance(m, (Fp8Linear, Fp8Experts))]


def fully_shard_fp8(
    model: nn.Module, *, reduce_dtype: torch.dtype | None = torch.float32, **fsdp_kwargs: Any
) -> list[nn.Module]:
    """``fully_shard`` each FP8 module of ``model`` in its own FSDP2 group whose
    ``MixedPrecisionPolicy`` keeps the stored dtypes (``param_dtype=None``: fp8 codes stay
    fp8, scales fp32) and leaves the inputs as they come (``cast_forward_inputs=False``: the
    enclosing group's policy casts them). ``fsdp_kwargs`` (``mesh``, ``reshard_after_forward``
    …) go to ``fully_shard``; an ``mp_policy`` there is refused (that is what this replaces).
    Call it before sharding the enclosing layers; returns the modules it sharded (FP8
    modules that already are FSDP2 groups are left as they are: calling it twice is harmless).

    ``accelerate`` users need not call it: with ``fsdp_version: 2`` and a casting
    ``mixed_precision``, hf_fp8 applies it inside ``accelerator.prepare`` (the
    ``accelerate_fsdp2`` patch, :mod:`hf_fp8.patches.accelerate_fsdp2`)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if "mp_policy" in fsdp_kwargs:
        raise ValueError(
            "fully_shard_fp8 sets its own mp_policy (param_dtype=None keeps the fp8 codes); "
            "give your MixedPrecisionPolicy to the fully_shard calls of the layers and the model"
        )
    keep = MixedPrecisionPolicy(
        param_dtype=None, reduce_dtype=reduce_dtype, cast_forward_inputs=False
    )
    modules = [m for m in fp8_modules(model) if not isinstance(m, FSDPModule)]
    for module in modules:
        fully_shard(module, mp_policy=keep, **fsdp_kwargs)
    return modules
