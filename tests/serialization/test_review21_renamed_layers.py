"""Reviewer R21 F2: ViT, DeiT and DINOv2 FP8 checkpoints could not be exported
(compressed-tensors, vLLM fp8) nor inspected. transformers 5.24 names their modules anew
(``vit.layers.0.attention.q_proj``) while ``save_pretrained`` writes the legacy names
(``vit.encoder.layer.0.attention.attention.query.weight``) through the model's conversion
mapping; the layer plan matched the meta model's module names against the on-disk names and
refused every fp8 weight ("not the weight of a linear layer"). The plan now maps each linear
through the save-time renaming; the foreign ``ignore`` lists name both the on-disk and the
model's name, hf_fp8's ``modules_to_not_convert`` the model's."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import transformers as tf
from torch import nn

import hf_fp8
from hf_fp8.serialization import export_checkpoint, import_checkpoint, inspect_checkpoint

IMAGE = 32


def _vit(root, skip=None, fmt="compressed-tensors"):
    cfg = tf.ViTConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE,
        patch_size=8,
        num_labels=3,
    )
    torch.manual_seed(0)
    tf.ViTForImageClassification(cfg).save_pretrained(root / "src")
    kwargs = {} if skip is None else {"modules_to_not_convert": skip}
    if fmt == "vllm-fp8":  # one scale per tensor
        kwargs["weight_granularity"] = "tensor"
    return tf.ViTForImageClassification.from_pretrained(
        root / "src", quantization_config=hf_fp8.Fp8Config("dynamic", **kwargs)
    )


def _dinov2(root):
    cfg = tf.Dinov2Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        mlp_ratio=2,
        image_size=IMAGE,
        patch_size=8,
    )
    torch.manual_seed(0)
    tf.Dinov2Model(cfg).save_pretrained(root / "src")
    return tf.Dinov2Model.from_pretrained(
        root / "src", quantization_config=hf_fp8.Fp8Config("dynamic")
    )


def _out(model) -> torch.Tensor:
    torch.manual_seed(1)
    pixels = torch.randn(2, 3, IMAGE, IMAGE)
    with torch.no_grad():
        out = model(pixel_values=pixels)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _saved_names(path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return list(f.keys())


def _roundtrip(model, root, fmt) -> tuple[torch.Tensor, dict]:
    """Export the saved FP8 folder to ``fmt``, import it back, reload it: its output and the
    export's quantization config."""
    if not (root / "fp8").exists():
        model.save_pretrained(root / "fp8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_checkpoint(root / "fp8", root / fmt, fmt)
        import_checkpoint(root / fmt, root / "back")
    qc = json.loads((root / fmt / "config.json").read_text())["quantization_config"]
    back = type(model).from_pretrained(root / "back")
    return _out(back), qc


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", ["compressed-tensors", "vllm-fp8"])
def test_vit_exports_imports_and_reloads_bit_exact(tmp_path, fmt):
    model = _vit(tmp_path, fmt=fmt)
    want = _out(model)
    model.save_pretrained(tmp_path / "fp8")
    # the premise: on disk the legacy names, in the model the new ones
    assert "vit.encoder.layer.0.attention.attention.query.weight_scale" in _saved_names(
        tmp_path / "fp8"
    )
    assert isinstance(model.get_submodule("vit.layers.0.attention.q_proj"), hf_fp8.Fp8Linear)
    got, qc = _roundtrip(model, tmp_path, fmt)
    assert torch.equal(got, want)
    ignored = qc.get("ignore", qc.get("ignored_layers"))
    assert ignored == ["classifier"]


@pytest.mark.timeout(300)
def test_vit_layer_kept_in_high_precision_by_its_model_name(tmp_path):
    """A skipped linear whose name changes on save: the export's ignore list names it both
    ways (vLLM maps checkpoint names, transformers' compressed-tensors loader module names),
    the import's ``modules_to_not_convert`` the model's name, so the reload keeps it."""
    model = _vit(tmp_path, skip=["classifier", "vit.layers.0.attention.q_proj"])
    assert isinstance(model.get_submodule("vit.layers.0.attention.q_proj"), nn.Linear)
    assert not isinstance(model.get_submodule("vit.layers.0.attention.q_proj"), hf_fp8.Fp8Linear)
    want = _out(model)
    got, qc = _roundtrip(model, tmp_path, "compressed-tensors")
    assert torch.equal(got, want)
    assert sorted(qc["ignore"]) == [
        "classifier",
        "vit.encoder.layer.0.attention.attention.query",
        "vit.layers.0.attention.q_proj",
    ]
    back = json.loads((tmp_path / "back" / "config.json").read_text())["quantization_config"]
    assert sorted(back["modules_to_not_convert"]) == ["classifier", "vit.layers.0.attention.q_proj"]


@pytest.mark.timeout(300)
def test_inspect_of_vit_lists_the_kept_layers(tmp_path):
    model = _vit(tmp_path)
    model.save_pretrained(tmp_path / "fp8")
    summary = inspect_checkpoint(tmp_path / "fp8")
    assert summary.note is None
    assert summary.high_precision_layers == ["classifier"]
    assert len(summary.fp8_layers) == 12  # 2 layers x (q, k, v, o, fc1, fc2)
    assert "vit.encoder.layer.1.output.dense" in summary.fp8_layers


@pytest.mark.timeout(300)
def test_dinov2_exports_imports_and_reloads_bit_exact(tmp_path):
    model = _dinov2(tmp_path)
    want = _out(model)
    got, qc = _roundtrip(model, tmp_path, "compressed-tensors")
    assert torch.equal(got, want)
    assert qc["ignore"] == []


def _tiny(name):
    small = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4)
    vision = dict(**small, image_size=IMAGE, patch_size=8, num_hidden_layers=1)
    return {
        "llama": lambda: tf.LlamaForCausalLM(
            tf.LlamaConfig(vocab_size=64, num_hidden_layers=1, num_key_value_heads=2, **small)
        ),
        "bert": lambda: tf.BertForMaskedLM(
            tf.BertConfig(vocab_size=64, num_hidden_layers=1, **small)
        ),
        "t5": lambda: tf.T5ForConditionalGeneration(
            tf.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
        ),
        "whisper": lambda: tf.WhisperForConditionalGeneration(
            tf.WhisperConfig(
                vocab_size=64,
                d_model=32,
                encoder_layers=1,
                decoder_layers=1,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
                num_mel_bins=8,
                max_source_positions=16,
                max_target_positions=16,
                pad_token_id=1,
                bos_token_id=1,
                eos_token_id=2,
                decoder_start_token_id=1,
            )
        ),
        "clip": lambda: tf.CLIPModel(
            tf.CLIPConfig(
                text_config=dict(vocab_size=64, num_hidden_layers=1, **small),
                vision_config=vision,
                projection_dim=16,
            )
        ),
        "vit": lambda: tf.ViTForImageClassification(tf.ViTConfig(**vision)),
        "deit": lambda: tf.DeiTForImageClassification(tf.DeiTConfig(**vision)),
        "dinov2": lambda: tf.Dinov2Model(
            tf.Dinov2Config(
                hidden_size=32,
                num_attention_heads=4,
                mlp_ratio=2,
                image_size=IMAGE,
                patch_size=8,
                num_hidden_layers=1,
            )
        ),
    }[name]()


@pytest.mark.parametrize(
    "name", ["llama", "bert", "t5", "whisper", "clip", "vit", "deit", "dinov2"]
)
def test_plan_names_are_the_names_save_pretrained_writes(tmp_path, name):
    """Reference: the tensor names transformers' own save_pretrained writes. Where they are
    the module names (Llama, BERT, T5, Whisper, CLIP) nothing changes."""
    from hf_fp8.serialization.layers import saved_linear_layers

    model = _tiny(name)
    model.save_pretrained(tmp_path)
    on_disk = set(_saved_names(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    params = dict(model.named_parameters())  # a tied weight once, under its first name
    plan = saved_linear_layers(config)  # without the names: what save_pretrained writes
    assert {model_name for _, model_name in plan.values()} == linears
    for disk_name, (_, model_name) in plan.items():
        tied = f"{model_name}.weight" not in params  # shared with the embeddings: not saved
        assert tied or f"{disk_name}.weight" in on_disk, (model_name, disk_name)
    renamed = any(disk_name != model_name for disk_name, (_, model_name) in plan.items())
    assert renamed == (name in ("vit", "deit", "dinov2"))
    assert saved_linear_layers(config, on_disk) == plan  # with them, the same
