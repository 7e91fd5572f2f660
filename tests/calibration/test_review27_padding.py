"""R27 F1: calibrate observes only the real tokens of a padded batch (its attention_mask).

References: forward pre-hooks on the *unquantized* model, max |x| over the positions the
mask keeps, / 448; for experts, max |x| over the rows the router sent to each expert from
real tokens."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8 import Fp8Config, Fp8Linear
from hf_fp8.modules.fp8_experts import Fp8Experts
from tests.modules.moe_zoo import build_tiny, experts_classes

PAD = 0


def _padded_batch() -> dict:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 128, (4, 16), generator=gen)
    mask = torch.ones_like(ids)
    for row, length in [(1, 6), (2, 4), (3, 8)]:  # right padding
        ids[row, length:], mask[row, length:] = PAD, 0
    return {"input_ids": ids, "attention_mask": mask}


def _spiky_pad(model: nn.Module) -> None:
    """The pad token's embedding: one large channel (a spike after the norm)."""
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[PAD].zero_()
        emb[PAD, 5] = 1.0


def _run_with_input_hooks(model: nn.Module, batch: dict, hook) -> None:
    """One forward of ``batch`` with ``hook(module, args, name)`` before every linear but
    ``lm_head`` (the float model's real inputs: the reference)."""
    hooks = [
        m.register_forward_pre_hook(lambda m, a, n=name: hook(m, a, n))
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name != "lm_head"
    ]
    with torch.no_grad():
        model(**batch)
    for h in hooks:
        h.remove()


def _reference(path: str, batch: dict) -> tuple[dict[str, float], dict[str, float]]:
    """(amax over real tokens, amax over every position) of each linear's input."""
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    _spiky_pad(model)
    keep = batch["attention_mask"].bool()
    real: dict[str, float] = {}
    every: dict[str, float] = {}

    def hook(_m, args, name):
        x = args[0].detach().float()
        real[name] = max(real.get(name, 0.0), float(x[keep].abs().max()))
        every[name] = max(every.get(name, 0.0), float(x.abs().max()))

    _run_with_input_hooks(model, batch, hook)
    return real, every


def test_padded_positions_are_not_observed(tiny_model_dir):
    path = tiny_model_dir("llama")
    batch = _padded_batch()
    real, every = _reference(path, batch)
    q = "model.layers.0.self_attn.q_proj"
    assert every[q] > 1.5 * real[q]  # the padding would change the scale a lot
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=Fp8Config("static"))
    _spiky_pad(model)
    scales = hf_fp8.calibrate(model, batch, progress=False)
    static = {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert static == real.keys()
    for name, amax in real.items():
        assert scales[name] == pytest.approx(amax / 448, rel=0.05), name


def test_an_all_ones_mask_and_no_mask_agree(tiny_model_dir):
    path = tiny_model_dir("llama")
    ids = _padded_batch()["input_ids"]
    got = []
    for batch in ({"input_ids": ids}, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}):
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=Fp8Config("static"))
        got.append(hf_fp8.calibrate(model, batch, progress=False))
    assert got[0] == got[1]


QWEN3 = next(c for c in experts_classes() if c.__name__ == "Qwen3MoeExperts")


class _Moe(nn.Module):
    """Takes a tokenizer-like batch: [B, S, H] states, the routing of the B*S tokens, a mask."""

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.experts = experts

    def forward(self, hidden, index, weights, attention_mask=None):
        return self.experts(hidden.reshape(-1, hidden.shape[-1]), index, weights)


def test_experts_see_only_real_tokens_and_pad_only_experts_warn():
    fp8 = Fp8Experts.from_experts(build_tiny(QWEN3), Fp8Config("static"))
    last = fp8.num_experts - 1
    gen = torch.Generator().manual_seed(0)
    batch, seq, hidden = 2, 6, fp8.layout.hidden_size
    x = torch.randn(batch, seq, hidden, generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, 2:], mask[1, 4:] = 0, 0
    x[~mask.bool()] *= 10  # padded positions: large values
    logits = torch.randn(batch * seq, fp8.num_experts, generator=gen)
    pad = ~mask.reshape(-1).bool()
    logits[~pad, last] = -1e9  # only padded tokens reach the last expert
    logits[pad, last] = 1e9
    weights, index = torch.topk(logits.softmax(-1), 2, dim=-1)
    inputs = {"hidden": x, "index": index, "weights": weights, "attention_mask": mask}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scales = hf_fp8.calibrate(_Moe(fp8), inputs, progress=False)
    messages = [str(w.message) for w in caught]
    assert any("saw no tokens" in m and f"experts.gate_up_proj[{last}]" in m for m in messages), (
        messages
    )
    tokens = x.reshape(-1, hidden)
    for e in range(last):
        rows = tokens[(index == e).any(dim=-1) & ~pad]
        if rows.shape[0] == 0:
            continue
        assert scales[f"experts.gate_up_proj[{e}]"] == pytest.approx(
            float(rows.abs().max()) / 448, rel=1e-6
        ), e
    calibrated = [v for k, v in scales.items() if not k.endswith(f"[{last}]")]
    assert scales[f"experts.gate_up_proj[{last}]"] == max(calibrated)


def _t5_reference(path: str, batch: dict) -> dict[str, float]:
    """max |x| per linear: the encoder's and the cross-attention k / v (which read the
    encoder's output) over the unpadded encoder positions, the decoder's over all."""
    from transformers import T5ForConditionalGeneration

    model = T5ForConditionalGeneration.from_pretrained(path).eval()
    _spiky_pad(model)
    keep = batch["attention_mask"].bool()
    seen: dict[str, float] = {}

    def hook(_m, args, name):
        x = args[0].detach().float()
        encoder_side = name.startswith("encoder.") or name.endswith(
            ("EncDecAttention.k", "EncDecAttention.v")
        )
        x = x[keep] if encoder_side else x
        seen[name] = max(seen.get(name, 0.0), float(x.abs().max()))

    _run_with_input_hooks(model, batch, hook)
    return seen


def test_encoder_decoder_masks_the_encoder_side_only(tiny_model_dir):
    from transformers import T5ForConditionalGeneration

    path = tiny_model_dir("t5")
    batch = _padded_batch()
    batch["decoder_input_ids"] = batch["input_ids"][:, :5].clone()
    batch["decoder_input_ids"][:, 0] = 0
    reference = _t5_reference(path, batch)
    model = T5ForConditionalGeneration.from_pretrained(
        path, quantization_config=Fp8Config("static")
    )
    _spiky_pad(model)
    scales = hf_fp8.calibrate(model, batch, progress=False)
    assert len(scales) > 10 and scales.keys() <= reference.keys()  # T5 keeps wo unquantized
    for name, scale in scales.items():
        assert scale == pytest.approx(reference[name] / 448, rel=0.05), name


def test_a_tuple_batch_masks_by_the_forward_parameter_names(tiny_model_dir):
    # LlamaForCausalLM.forward(input_ids, attention_mask, ...): [(ids, mask)] is one batch
    path = tiny_model_dir("llama")
    batch = _padded_batch()
    real, _ = _reference(path, batch)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=Fp8Config("static"))
    _spiky_pad(model)
    scales = hf_fp8.calibrate(
        model, [(batch["input_ids"], batch["attention_mask"])], progress=False
    )
    for name, amax in real.items():
        assert scales[name] == pytest.approx(amax / 448, rel=0.05), name
