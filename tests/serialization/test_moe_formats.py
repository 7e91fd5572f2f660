"""MoE experts in the foreign formats, on disk (issue 11 §2): ``fp8`` block checkpoints with
one fp8 linear per expert (Qwen3-MoE-FP8 / DeepSeek-V3) import into Fp8Experts' merged names
with the same bits; exports write one linear per expert again."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_fp8.serialization import export_checkpoint, import_checkpoint
from hf_fp8.serialization.experts import expert_merges
from tests.serialization.moe_fixtures import tiny_qwen3_moe, write_fp8_block_checkpoint

P = "model.layers.1.mlp.experts"


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.fixture(scope="module")
def fp8_block_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe") / "fp8"
    written = write_fp8_block_checkpoint(tiny_qwen3_moe(), out)
    return out, written


def test_merges_come_from_transformers_mapping() -> None:
    merges = expert_merges("qwen3_moe")
    assert [m.target for m in merges] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert merges[0].sources == ("mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight")
    assert expert_merges("llama") == []


def test_import_merges_per_expert_fp8_bit_for_bit(fp8_block_dir, tmp_path) -> None:
    src, written = fp8_block_dir
    out = import_checkpoint(src, tmp_path / "imported")
    got = load_file(out / "model.safetensors")
    assert not any(".experts.0." in k for k in got)
    for e in range(4):
        gate, up = (written[f"{P}.{e}.{p}.weight"] for p in ("gate_proj", "up_proj"))
        assert torch.equal(_u8(got[f"{P}.gate_up_proj"][e]), _u8(torch.cat([gate, up])))
        assert torch.equal(_u8(got[f"{P}.down_proj"][e]), _u8(written[f"{P}.{e}.down_proj.weight"]))
        scales = [written[f"{P}.{e}.{p}.weight_scale_inv"] for p in ("gate_proj", "up_proj")]
        assert torch.equal(got[f"{P}.gate_up_proj_weight_scale"][e], torch.cat(scales))
    assert got[f"{P}.gate_up_proj"].dtype == torch.float8_e4m3fn
    assert got[f"{P}.gate_up_proj_weight_scale"].shape == (4, 2, 1)  # [E, 256/128, 128/128]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["weight_granularity"], qc["block_size"]) == (
        "hf_fp8",
        "block",
        [128, 128],
    )
    assert qc["modules_to_not_convert"] == ["lm_head"]


def test_import_then_export_gives_the_source_back(fp8_block_dir, tmp_path) -> None:
    src, _ = fp8_block_dir
    imported = import_checkpoint(src, tmp_path / "imported")
    back = export_checkpoint(imported, tmp_path / "vllm", "vllm-fp8")
    a, b = load_file(src / "model.safetensors"), load_file(back / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(_u8(a[key]), _u8(b[key])), key
    qc = json.loads((back / "config.json").read_text())["quantization_config"]
    assert qc["weight_block_size"] == [128, 128] and qc["ignored_layers"] == ["lm_head"]


def test_compressed_tensors_export_is_per_expert(fp8_block_dir, tmp_path) -> None:
    src, written = fp8_block_dir
    imported = import_checkpoint(src, tmp_path / "imported")
    ct = export_checkpoint(imported, tmp_path / "ct", "compressed-tensors")
    got = load_file(ct / "model.safetensors")
    assert not any(k.endswith("gate_up_proj") for k in got)
    for e in range(4):
        for p in ("gate_proj", "up_proj", "down_proj"):
            key = f"{P}.{e}.{p}"
            assert torch.equal(_u8(got[f"{key}.weight"]), _u8(written[f"{key}.weight"]))
            assert torch.equal(got[f"{key}.weight_scale"], written[f"{key}.weight_scale_inv"])


def test_incomplete_experts_are_refused(fp8_block_dir, tmp_path) -> None:
    src, _ = fp8_block_dir
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    del tensors[f"{P}.3.up_proj.weight"], tensors[f"{P}.3.up_proj.weight_scale_inv"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"experts\.gate_up_proj.*incomplete"):
        import_checkpoint(broken, tmp_path / "out")


def test_blocks_straddling_gate_and_up_are_refused(tmp_path) -> None:
    model = tiny_qwen3_moe()
    for layer in model.model.layers:  # 96 gate rows: a 128-row block would hold gate and up
        experts = layer.mlp.experts
        experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj[:, :192].clone())
        experts.down_proj = torch.nn.Parameter(experts.down_proj[:, :, :96].clone())
    model.config.moe_intermediate_size = 96
    write_fp8_block_checkpoint(model, tmp_path / "src")
    with pytest.raises(ValueError, match=r"gate_up_proj: \[96, 96\] output rows"):
        import_checkpoint(tmp_path / "src", tmp_path / "out")


def test_experts_split_across_shards_are_merged(fp8_block_dir, tmp_path) -> None:
    src, written = fp8_block_dir
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    half = [n for n in names if ".experts.2." in n or ".experts.3." in n]  # second shard
    first = {n: tensors[n] for n in names if n not in half}
    second = {n: tensors[n] for n in half}
    save_file(first, sharded / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file(second, sharded / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    weight_map = {n: "model-00001-of-00002.safetensors" for n in first}
    weight_map.update({n: "model-00002-of-00002.safetensors" for n in second})
    index = {"metadata": {}, "weight_map": weight_map}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    out = import_checkpoint(sharded, tmp_path / "out")
    got = {}
    for file in out.glob("model-*.safetensors"):
        got.update(load_file(file))
    merged = got[f"{P}.down_proj"]
    for e in range(4):
        assert torch.equal(_u8(merged[e]), _u8(written[f"{P}.{e}.down_proj.weight"]))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"][f"{P}.down_proj"] == "model-00002-of-00002.safetensors"


def test_export_of_fused_experts_without_a_mapping_is_refused(tmp_path) -> None:
    """Llama-4's FP8 experts are saved fused and transformers has no per-expert names for
    them: an export would write the fused tensors into a compressed-tensors checkpoint that no
    loader reads (before: written silently; transformers then failed on random init)."""
    import transformers as tf

    from hf_fp8 import Fp8Config
    from tests.modules.test_fp8_bmm_experts import TEXT

    torch.manual_seed(0)
    tf.Llama4ForCausalLM(tf.Llama4TextConfig(**TEXT)).save_pretrained(tmp_path / "hp")
    model = tf.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hp", quantization_config=Fp8Config("dynamic")
    )
    model.save_pretrained(tmp_path / "fp8")
    with pytest.raises(
        ValueError, match=r"experts\.down_proj \(and 3 more\).*fused.*'llama4_text'"
    ):
        export_checkpoint(tmp_path / "fp8", tmp_path / "ct", "compressed-tensors")
    assert not (tmp_path / "ct").exists()


def _hf_fp8_moe_dir(tmp_path, intermediate: int, block: tuple[int, int]):
    """A tiny Qwen3-MoE quantized by hf_fp8 with block weight scales, saved; its model."""
    import transformers as tf

    from hf_fp8 import Fp8Config

    torch.manual_seed(0)
    cfg = tf.Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=intermediate,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    tf.Qwen3MoeForCausalLM(cfg).save_pretrained(tmp_path / "hp")
    fp8 = Fp8Config(
        "dynamic", weight_granularity="block", block_size=block, activation_granularity="token"
    )
    model = tf.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hp", dtype=torch.float32, quantization_config=fp8
    )
    model.save_pretrained(tmp_path / "fp8")
    return tmp_path / "fp8"


@pytest.mark.parametrize("fmt", ["compressed-tensors", "vllm-fp8"])
@pytest.mark.parametrize("intermediate", [64, 96])
def test_export_of_blocks_straddling_gate_and_up_is_refused(tmp_path, intermediate, fmt) -> None:
    """Reviewer: with 2·I not a multiple of the 128-row block, one block's scale covers gate
    and up rows; the export cut the fused scale in halves (I=96: up got block row 1 although
    its rows 96..127 were quantized with block row 0; I=64: no up_proj scale at all)."""
    src = _hf_fp8_moe_dir(tmp_path, intermediate, (128, 128))
    with pytest.raises(ValueError, match=r"gate_up_proj.*straddle.*block height that divides"):
        export_checkpoint(src, tmp_path / "out", fmt)
    assert not (tmp_path / "out").exists()


def test_export_of_exact_block_split_matches_the_model(tmp_path) -> None:
    """Blocks that begin at each source's first row split exactly: the exported per-expert
    weights dequantize to the hf_fp8 checkpoint's own (reference: fused codes × fused
    block scales, expanded here)."""
    src = _hf_fp8_moe_dir(tmp_path, 64, (32, 128))
    out = export_checkpoint(src, tmp_path / "ct", "compressed-tensors")
    hf, ct = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    p = "model.layers.0.mlp.experts"

    def deq(codes: torch.Tensor, scale: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
        s = scale.repeat_interleave(bn, 0)[: codes.shape[0]]
        return codes.float() * s.repeat_interleave(bk, 1)[:, : codes.shape[1]]

    for e in range(4):
        fused = torch.cat([hf[f"{p}.{e}.{n}.weight"] for n in ("gate_proj", "up_proj")])
        ref = deq(fused, hf[f"{p}.gate_up_proj_weight_scale"][e], 32, 128)
        for i, name in enumerate(("gate_proj", "up_proj")):
            got = deq(ct[f"{p}.{e}.{name}.weight"], ct[f"{p}.{e}.{name}.weight_scale"], 32, 128)
            assert torch.equal(got, ref[64 * i : 64 * (i + 1)]), (e, name)
