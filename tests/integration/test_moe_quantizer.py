"""MoE experts through ``from_pretrained`` / ``save_pretrained`` (issue 11 §2): the quantizer
swaps every experts module for ``Fp8Experts``, quantizes the merged per-expert checkpoint
tensors on the fly, reloads its own saves bit for bit, validates what it loads, dequantizes."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from hf_fp8 import Fp8Config
from hf_fp8.modules.fp8_experts import Fp8Experts
from hf_fp8.numerics import quantize_weight
from hf_fp8.numerics.checks import CheckpointTensorError
from tests.tiny_models import LLAMA_LAYER_1_ON_DISK, tiny_mixtral

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _qwen3_moe() -> tf.PreTrainedModel:
    cfg = tf.Qwen3MoeConfig(
        **_COMMON,
        intermediate_size=128,
        moe_intermediate_size=32,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
    )
    return tf.Qwen3MoeForCausalLM(cfg).eval()


def _mixtral() -> tf.PreTrainedModel:
    return tiny_mixtral()


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = _qwen3_moe()
    path = tmp_path_factory.mktemp("qwen3moe") / "hp"
    model.save_pretrained(path)
    return path, model


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_on_the_fly_quantizes_merged_experts(bf16_dir):
    path, ref = bf16_dir
    model = tf.AutoModelForCausalLM.from_pretrained(path, quantization_config=Fp8Config())
    experts = model.model.layers[1].mlp.experts
    assert isinstance(experts, Fp8Experts)
    source = ref.model.layers[1].mlp.experts
    for proj in ("gate_up_proj", "down_proj"):  # reference: each expert quantized alone
        codes, scales = zip(
            *(
                quantize_weight(getattr(source, proj)[e].detach(), torch.float8_e4m3fn, "row")
                for e in range(8)
            ),
            strict=True,
        )
        assert torch.equal(_bytes(getattr(experts, proj)), _bytes(torch.stack(codes)))
        assert torch.equal(getattr(experts, f"{proj}_weight_scale"), torch.stack(scales))
        assert not getattr(experts, proj).requires_grad
    with torch.no_grad():
        assert _rel(model(_ids()).logits, ref(_ids()).logits) < 0.1


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"weight_granularity": "block", "block_size": (16, 16)},
        {"weight_granularity": "tensor", "activation_scheme": "weight_only"},
        {"activation_scheme": "static", "activation_scale": 0.05},
    ],
    ids=["row", "block", "tensor", "static"],
)
def test_save_reload_bit_exact(bf16_dir, tmp_path, kwargs):
    path, _ = bf16_dir
    model = tf.AutoModelForCausalLM.from_pretrained(path, quantization_config=Fp8Config(**kwargs))
    model.save_pretrained(tmp_path / "fp8")
    stored = load_file(tmp_path / "fp8" / "model.safetensors")
    # transformers' reverse mapping splits the codes per expert; the scales keep fused names
    assert stored["model.layers.0.mlp.experts.3.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert "model.layers.0.mlp.experts.gate_up_proj_weight_scale" in stored
    back = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8")
    assert isinstance(back.model.layers[0].mlp.experts, Fp8Experts)
    a, b = model.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(_bytes(a[key]), _bytes(b[key])), key
    with torch.no_grad():
        assert torch.equal(model(_ids()).logits, back(_ids()).logits)


@pytest.mark.parametrize("scheme", ["dynamic", "static"])
def test_load_report_lists_nothing_missing(bf16_dir, scheme):
    """A static on-the-fly load with ``activation_scale`` listed every experts input scale as
    "MISSING ... newly initialized" in transformers' load report (the scales were set)."""
    path, _ = bf16_dir
    kwargs = {"activation_scale": 0.05} if scheme == "static" else {}
    model, info = tf.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=Fp8Config(scheme, **kwargs), output_loading_info=True
    )
    assert not info["missing_keys"], sorted(info["missing_keys"])[:4]
    if scheme == "static":
        scale = model.model.layers[0].mlp.experts.gate_up_proj_input_scale
        assert torch.equal(scale, torch.full_like(scale, 0.05))


def test_dequantize_gives_the_source_class(bf16_dir, tmp_path):
    path, _ = bf16_dir
    config = Fp8Config(activation_scheme="weight_only")  # same math as the dequantized model
    model = tf.AutoModelForCausalLM.from_pretrained(path, quantization_config=config)
    model.save_pretrained(tmp_path / "fp8")
    dq = tf.AutoModelForCausalLM.from_pretrained(
        tmp_path / "fp8", quantization_config=Fp8Config(dequantize=True)
    )
    experts = dq.model.layers[0].mlp.experts
    assert type(experts).__name__ == "Qwen3MoeExperts"
    fp8 = model.model.layers[0].mlp.experts
    assert torch.equal(experts.gate_up_proj, fp8.dequantize_weight("gate_up_proj"))
    with torch.no_grad():
        assert torch.allclose(dq(_ids()).logits, model(_ids()).logits, atol=1e-5)


def test_corrupt_expert_scale_is_refused_by_name(bf16_dir, tmp_path):
    path, _ = bf16_dir
    model = tf.AutoModelForCausalLM.from_pretrained(path, quantization_config=Fp8Config())
    model.save_pretrained(tmp_path / "fp8")
    file = tmp_path / "fp8" / "model.safetensors"
    tensors = load_file(file)
    key = "model.layers.1.mlp.experts.down_proj_weight_scale"
    tensors[key] = tensors[key].clone()
    tensors[key][2, 5] = float("nan")
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointTensorError, match=r"experts\.down_proj_weight_scale"):
        tf.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8")


def test_fp8_checkpoint_with_on_the_fly_config_is_refused(bf16_dir, tmp_path):
    path, _ = bf16_dir
    model = tf.AutoModelForCausalLM.from_pretrained(path, quantization_config=Fp8Config())
    model.config.quantization_config = None
    model.save_pretrained(tmp_path / "fp8")
    with pytest.raises(ValueError, match="already"):
        tf.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", quantization_config=Fp8Config())


def test_mixtral_renamed_experts_and_device_map(tmp_path):
    torch.manual_seed(0)
    ref = _mixtral()
    ref.save_pretrained(tmp_path / "hp")
    model = tf.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hp", quantization_config=Fp8Config(), device_map={"": "cpu"}
    )
    assert all(isinstance(layer.mlp.experts, Fp8Experts) for layer in model.model.layers)
    with torch.no_grad():
        assert _rel(model(_ids()).logits, ref(_ids()).logits) < 0.1


def test_modules_to_not_convert_keeps_experts(bf16_dir):
    path, _ = bf16_dir
    config = Fp8Config(modules_to_not_convert=["model.layers.0.mlp.experts"])
    model = tf.AutoModelForCausalLM.from_pretrained(path, quantization_config=config)
    assert type(model.model.layers[0].mlp.experts).__name__ == "Qwen3MoeExperts"
    assert isinstance(model.model.layers[1].mlp.experts, Fp8Experts)


def test_imported_fp8_block_moe_loads_with_the_same_bits(tmp_path):
    from hf_fp8.serialization import import_checkpoint
    from tests.serialization.moe_fixtures import tiny_qwen3_moe, write_fp8_block_checkpoint

    ref = tiny_qwen3_moe()
    written = write_fp8_block_checkpoint(ref, tmp_path / "src")
    model = tf.AutoModelForCausalLM.from_pretrained(
        import_checkpoint(tmp_path / "src", tmp_path / "hf")
    )
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, Fp8Experts) and experts.weight_granularity == "block"
    p = "model.layers.0.mlp.experts"
    for e in range(4):
        up = written[f"{p}.{e}.up_proj.weight"]
        assert torch.equal(_bytes(experts.gate_up_proj[e, 128:]), _bytes(up))
        assert torch.equal(
            experts.down_proj_weight_scale[e], written[f"{p}.{e}.down_proj.weight_scale_inv"]
        )
    with torch.no_grad():
        assert _rel(model(_ids()).logits, ref(_ids()).logits) < 0.1


@pytest.mark.parametrize("granularity", ["row", "tensor"])
def test_compressed_tensors_export_loads_in_stock_transformers(bf16_dir, tmp_path, granularity):
    from hf_fp8.serialization import export_checkpoint, import_checkpoint

    path, _ = bf16_dir
    # weight-only: stock transformers dequantizes FP8 experts and runs them in high precision
    config = Fp8Config(activation_scheme="weight_only", weight_granularity=granularity)
    model = tf.AutoModelForCausalLM.from_pretrained(path, quantization_config=config)
    out = export_checkpoint(model, tmp_path / "ct", "compressed-tensors")
    assert "model.layers.0.mlp.experts.5.up_proj.weight_scale" in load_file(
        out / "model.safetensors"
    )
    stock = tf.AutoModelForCausalLM.from_pretrained(out)
    assert type(stock.model.layers[0].mlp.experts).__name__ == "Qwen3MoeExperts"
    with torch.no_grad():
        got, want = stock(_ids()).logits, model(_ids()).logits
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    back = tf.AutoModelForCausalLM.from_pretrained(import_checkpoint(out, tmp_path / "back"))
    a, b = model.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(_bytes(a[key]), _bytes(b[key])), key


def test_quantize_model_converts_experts_like_from_pretrained(bf16_dir, tmp_path):
    from hf_fp8 import quantize_model

    path, _ = bf16_dir
    loaded = tf.AutoModelForCausalLM.from_pretrained(path, quantization_config=Fp8Config())
    model = quantize_model(  # no default skips here: keep lm_head as from_pretrained does
        tf.AutoModelForCausalLM.from_pretrained(path), Fp8Config(), skip=["lm_head"]
    )
    assert isinstance(model.model.layers[0].mlp.experts, Fp8Experts)
    a, b = loaded.state_dict(), model.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(_bytes(a[key]), _bytes(b[key])), key


def test_experts_kept_by_skip_stay_high_precision_after_reload(bf16_dir, tmp_path):
    from hf_fp8 import quantize_model

    path, _ = bf16_dir
    model = quantize_model(
        tf.AutoModelForCausalLM.from_pretrained(path),
        Fp8Config(),
        skip=["model.layers.0.mlp.experts"],
    )
    model.save_pretrained(tmp_path / "fp8")
    back = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8")
    assert type(back.model.layers[0].mlp.experts).__name__ == "Qwen3MoeExperts"
    assert isinstance(back.model.layers[1].mlp.experts, Fp8Experts)
    assert "model.layers.0.mlp.experts" in back.config.quantization_config.modules_to_not_convert
    with torch.no_grad():
        assert torch.equal(model(_ids()).logits, back(_ids()).logits)


def test_keep_reason_names_the_experts_rule(bf16_dir):
    from hf_fp8.modules import keep_reason

    _, ref = bf16_dir
    experts = ref.model.layers[0].mlp.experts
    assert "converted by Fp8Experts" in keep_reason(experts, "model.layers.0.mlp.experts")
    reason = keep_reason(experts, "model.layers.0.mlp.experts", skip=["model.layers.0.mlp.experts"])
    assert "modules_to_not_convert" in reason


def test_sharded_save_reloads_bit_exact(bf16_dir, tmp_path):
    path, _ = bf16_dir
    model = tf.AutoModelForCausalLM.from_pretrained(path, quantization_config=Fp8Config())
    model.save_pretrained(tmp_path / "fp8", max_shard_size="20KB")
    assert len(list((tmp_path / "fp8").glob("model-*.safetensors"))) > 2
    back = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8")
    a, b = model.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(_bytes(a[key]), _bytes(b[key])), key


def test_fp8_experts_offloaded_to_disk_give_the_same_logits(bf16_dir, tmp_path):
    path, _ = bf16_dir
    model = tf.AutoModelForCausalLM.from_pretrained(path, quantization_config=Fp8Config())
    model.save_pretrained(tmp_path / "fp8")
    device_map = dict(LLAMA_LAYER_1_ON_DISK)
    back = tf.AutoModelForCausalLM.from_pretrained(
        tmp_path / "fp8", device_map=device_map, offload_folder=str(tmp_path / "offload")
    )
    assert isinstance(back.model.layers[1].mlp.experts, Fp8Experts)
    with torch.no_grad():
        assert torch.equal(back(_ids()).logits, model(_ids()).logits)
