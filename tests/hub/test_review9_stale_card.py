"""Measured figures of an earlier card must not describe another model (stale cards, session 9).

(a) An export into a folder that already holds an old export card: the new card states the
    figures its source recorded, never the old card's (export cards record no
    quantization_config, so the old card looked like "the same model").
(b) A pre-quantized static model calibrated again: its static scales changed, so the figures
    measured with the scales it was loaded with leave its card, whether it is saved into a new
    folder or back into the one it came from.

The reference for "stale" is the figure written before the change: it must not reappear.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8 import Fp8Config
from hf_fp8.hub import CardInfo, read_card_info
from hf_fp8.hub.card import same_model
from hf_fp8.modules import Fp8Linear

OLD = {"logits relative error": 0.0123}
NEW = {"logits relative error": 0.0456}


def _card(folder) -> CardInfo:
    return read_card_info((folder / "README.md").read_text(encoding="utf-8"))


def _text(folder) -> str:
    return (folder / "README.md").read_text(encoding="utf-8")


def _quantized(source: str, config: Fp8Config, fidelity: dict | None = None):
    model = AutoModelForCausalLM.from_pretrained(source, quantization_config=config)
    if fidelity:
        hf_fp8.set_card_info(model, fidelity=fidelity)
    return model


# -- (a) exports ----------------------------------------------------------------------------------
SKIP_Q = ["lm_head", "o_proj"]  # another model; vLLM fuses q_proj with k/v (R33 F3: refused)


@pytest.mark.parametrize("fmt", ["compressed-tensors", "vllm-fp8"])
def test_export_over_an_old_export_does_not_keep_its_figures(tiny_model_dir, tmp_path, fmt):
    source = tiny_model_dir("llama")
    out = tmp_path / "out"
    recipe = {"weight_granularity": "tensor"}  # one both formats hold
    hf_fp8.export(_quantized(source, Fp8Config("dynamic", **recipe), OLD), out, fmt)
    assert _card(out).fidelity == OLD
    other = _quantized(source, Fp8Config("dynamic", modules_to_not_convert=SKIP_Q, **recipe))
    hf_fp8.export(other, out, fmt, overwrite=True)
    assert _card(out).fidelity == {}
    assert "0.0123" not in _text(out)


def test_export_of_a_folder_over_an_old_export_does_not_keep_its_figures(tiny_model_dir, tmp_path):
    source = tiny_model_dir("llama")
    out = tmp_path / "out"
    hf_fp8.export(_quantized(source, Fp8Config("dynamic"), OLD), out)
    other = Fp8Config("dynamic", modules_to_not_convert=SKIP_Q)
    _quantized(source, other).save_pretrained(tmp_path / "fp8")
    assert _card(tmp_path / "fp8").fidelity == {}  # the source states no figures
    hf_fp8.export(tmp_path / "fp8", out, overwrite=True)
    assert _card(out).fidelity == {} and "0.0123" not in _text(out)


def test_export_states_its_source_figures_over_an_old_card(tiny_model_dir, tmp_path):
    source = tiny_model_dir("llama")
    out = tmp_path / "out"
    hf_fp8.export(_quantized(source, Fp8Config("dynamic"), OLD), out)
    hf_fp8.export(_quantized(source, Fp8Config("dynamic"), NEW), out, overwrite=True)
    assert _card(out).fidelity == NEW
    # the source folder's card: its figures travel with it
    model = _quantized(source, Fp8Config("dynamic"), NEW)
    model.save_pretrained(tmp_path / "fp8")
    hf_fp8.export(_quantized(source, Fp8Config("dynamic"), OLD), tmp_path / "out2")
    hf_fp8.export(tmp_path / "fp8", tmp_path / "out2", overwrite=True)
    assert _card(tmp_path / "out2").fidelity == NEW


# -- (b) calibration of a pre-quantized static model ---------------------------------------------
@pytest.fixture
def static_dir(tiny_model_dir, tmp_path):
    """A static checkpoint (activation_scale 0.05 everywhere) whose card states OLD."""
    model = _quantized(tiny_model_dir("llama"), Fp8Config("static", activation_scale=0.05), OLD)
    model.save_pretrained(tmp_path / "static")
    assert _card(tmp_path / "static").fidelity == OLD
    return tmp_path / "static"


def _calibrated(folder):
    model = AutoModelForCausalLM.from_pretrained(folder)
    before = {n: float(m.input_scale) for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    ids = torch.randint(1, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match="measured before"):
        hf_fp8.calibrate(model, [{"input_ids": ids}], progress=False)
    after = {n: float(m.input_scale) for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert before and before != after  # the scales the figures were measured with are gone
    return model


def test_reloading_without_calibration_keeps_the_figures(static_dir, tmp_path):
    AutoModelForCausalLM.from_pretrained(static_dir).save_pretrained(tmp_path / "again")
    assert _card(tmp_path / "again").fidelity == OLD


def test_calibrated_model_saved_elsewhere_drops_the_old_figures(static_dir, tmp_path):
    _calibrated(static_dir).save_pretrained(tmp_path / "calibrated")
    assert _card(tmp_path / "calibrated").fidelity == {}
    assert "0.0123" not in _text(tmp_path / "calibrated")


def test_calibrated_model_saved_into_its_own_folder_drops_the_old_figures(static_dir):
    _calibrated(static_dir).save_pretrained(static_dir)
    assert _card(static_dir).fidelity == {} and "0.0123" not in _text(static_dir)


def test_calibrated_model_exported_drops_the_old_figures(static_dir, tmp_path):
    hf_fp8.export(_calibrated(static_dir), tmp_path / "ct")
    assert _card(tmp_path / "ct").fidelity == {} and "0.0123" not in _text(tmp_path / "ct")


def test_figures_measured_after_calibration_are_kept(static_dir, tmp_path):
    model = _calibrated(static_dir)
    hf_fp8.set_card_info(model, fidelity=NEW)
    model.save_pretrained(static_dir)
    assert _card(static_dir).fidelity == NEW


def test_same_model_compares_the_static_scales():
    """Cards of static models record a digest of their input scales: figures carry over only
    to the same scales; a card from a checkpoint folder (no digest) still takes them."""
    first = CardInfo(scheme={"activation_scheme": "static"}, static_scales="aaaa")
    assert same_model(first, CardInfo(scheme=dict(first.scheme), static_scales="aaaa"))
    assert not same_model(first, CardInfo(scheme=dict(first.scheme), static_scales="bbbb"))
    assert same_model(first, CardInfo(scheme=dict(first.scheme)))  # folder card: unknown
    older = CardInfo(scheme=dict(first.scheme))  # an older card: scales unknown
    assert not same_model(older, CardInfo(scheme=dict(first.scheme), static_scales="aaaa"))


def test_moe_experts_calibrated_drop_the_old_figures(tmp_path):
    """A static MoE model: calibration changes the per-expert input scales too, and the card's
    digest follows them (an expert's scale alone changes it)."""
    from hf_fp8.hub.card_info import static_scales_digest
    from hf_fp8.modules.fp8_experts import Fp8Experts
    from tests.serialization.moe_fixtures import tiny_qwen3_moe

    tiny_qwen3_moe().save_pretrained(tmp_path / "hp")
    config = Fp8Config("static", activation_scale=0.05)
    model = _quantized(str(tmp_path / "hp"), config, OLD)
    model.save_pretrained(tmp_path / "static")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "static")
    reloaded.save_pretrained(tmp_path / "static")  # same scales: the figures stay
    assert _card(tmp_path / "static").fidelity == OLD
    digest = _card(tmp_path / "static").static_scales
    assert digest == static_scales_digest(model)
    experts = next(m for m in model.modules() if isinstance(m, Fp8Experts))
    experts.down_proj_input_scale.data[1] *= 2
    assert static_scales_digest(model) != digest
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match="measured before"):
        hf_fp8.calibrate(reloaded, [{"input_ids": ids}], progress=False)
    reloaded.save_pretrained(tmp_path / "static")
    card = _card(tmp_path / "static")
    assert card.fidelity == {} and card.static_scales not in (None, digest)
