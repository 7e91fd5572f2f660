"""Import of Llama-4 experts kept in high precision, which a compressed-tensors export writes one
linear per expert (``experts.<e>.gate_proj`` / ``up_proj`` / ``down_proj.weight``): the import
fuses them back into ``Llama4TextExperts``' ``gate_up_proj [E, H, 2I]`` (gate first) and
``down_proj [E, I, H]``, bit for bit, also across shards; a per-expert set that is incomplete,
inconsistent, FP8 or mixed with fused tensors is refused naming the tensors, nothing written.

Sizes are not square (hidden 32, expert intermediate 16), so a missing transpose or a swapped
gate / up cannot pass unnoticed.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from hf_fp8 import Fp8Config
from hf_fp8.numerics.checks import CheckpointTensorError
from hf_fp8.serialization import export_checkpoint, import_checkpoint
from tests.serialization.test_moe_hp_ignore import SIZES

CONFIG = dict(
    **SIZES,  # the tiny MoE sizes of the high-precision-experts export tests
    intermediate_size=16,
    intermediate_size_mlp=48,
    num_local_experts=3,
)
EXPERTS = "model.layers.{i}.feed_forward.experts"
L1 = EXPERTS.format(i=1)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``(hp model, hf_fp8 model, compressed-tensors export, sharded export)``."""
    root = tmp_path_factory.mktemp("llama4")
    torch.manual_seed(0)
    hp = tf.Llama4ForCausalLM(tf.Llama4TextConfig(**CONFIG)).eval()
    with torch.no_grad():  # Llama4TextExperts starts gate_up_proj at zero
        for name, param in hp.named_parameters():
            if "experts." in name:
                param.normal_(0, 0.2)
    hp.save_pretrained(root / "hp")
    config = Fp8Config("dynamic", weight_granularity="tensor", modules_to_not_convert=["experts"])
    fp8 = tf.AutoModelForCausalLM.from_pretrained(
        root / "hp", dtype=torch.float32, quantization_config=config
    ).eval()
    export_checkpoint(fp8, root / "ct", "compressed-tensors")
    fp8.save_pretrained(root / "fp8_sharded", max_shard_size="20KB")
    export_checkpoint(root / "fp8_sharded", root / "ct_sharded", "compressed-tensors")
    return hp, fp8, root / "ct", root / "ct_sharded"


def _weights(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("sharded", [False, True])
def test_per_expert_weights_fuse_back_bit_exact(exported, tmp_path, sharded):
    hp, fp8, ct, ct_sharded = exported
    src = ct_sharded if sharded else ct
    if sharded:  # the experts of one layer span several shards
        files = {f.name for f in src.glob("*.safetensors") if any(L1 in k for k in load_file(f))}
        assert len(files) > 1, files
    assert f"{L1}.2.up_proj.weight" in _weights(src)
    back = import_checkpoint(src, tmp_path / "back")
    stored = _weights(back)
    reference = hp.state_dict()
    for i in range(CONFIG["num_hidden_layers"]):
        for leaf in ("gate_up_proj", "down_proj"):
            name = f"{EXPERTS.format(i=i)}.{leaf}"
            assert torch.equal(stored[name], reference[name]), name
    assert not [k for k in stored if ".experts.0." in k]
    model = tf.AutoModelForCausalLM.from_pretrained(back).eval()
    assert type(model.get_submodule(L1)).__name__ == "Llama4TextExperts"
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fp8(ids).logits)


def _tampered(exported, tmp_path, edit) -> tuple:
    src = tmp_path / "src"
    shutil.copytree(exported[2], src)
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    tensors = {k: v.clone().contiguous() for k, v in tensors.items()}  # a .t(), a shared one
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    return src, tmp_path / "back"


def _fp8_expert(t: dict) -> None:
    name = f"{L1}.1.gate_proj.weight"
    t[name] = t[name].to(torch.float8_e4m3fn)
    t[f"{L1}.1.gate_proj.weight_scale"] = torch.ones(1)


HOSTILE = {
    # edit, the words the error must hold
    "missing": (lambda t: t.pop(f"{L1}.2.up_proj.weight"), [f"missing {L1}.2.up_proj.weight"]),
    "extra_expert": (
        lambda t: t.update({f"{L1}.3.down_proj.weight": t[f"{L1}.0.down_proj.weight"]}),
        [f"unexpected {L1}.3.down_proj.weight", "3 experts"],
    ),
    "dtype": (
        lambda t: t.update({f"{L1}.0.down_proj.weight": t[f"{L1}.0.down_proj.weight"].bfloat16()}),
        ["BF16", "F32", f"{L1}.0.down_proj.weight"],
    ),
    "shape": (
        lambda t: t.update({f"{L1}.1.gate_proj.weight": t[f"{L1}.1.gate_proj.weight"].t()}),
        [f"{L1}.1.gate_proj.weight", "(32, 16)", "expected (16, 32)"],
    ),
    "mixed": (
        lambda t: t.update({f"{L1}.gate_up_proj": torch.zeros(3, 32, 32)}),
        [f"{L1}.gate_up_proj", "mixed"],
    ),
    "fp8": (_fp8_expert, [f"{L1}.1.gate_proj.weight", "FP8", "high precision only"]),
    "bias": (
        lambda t: t.update({f"{L1}.0.up_proj.bias": torch.zeros(16)}),
        [f"{L1}.0.up_proj.bias", "no such tensor"],
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_per_expert_sets_are_refused_naming_the_tensors(exported, tmp_path, case):
    edit, words = HOSTILE[case]
    src, out = _tampered(exported, tmp_path, edit)
    with pytest.raises(CheckpointTensorError) as err:
        import_checkpoint(src, out)
    for word in words:
        assert word in str(err.value), (word, str(err.value))
    assert not out.exists()


def test_qwen3_moe_per_expert_linears_are_not_fused(tmp_path):
    """Per-expert names under an experts module that is not bmm-style (Qwen3-MoE's, merged
    by transformers' own conversion mapping) are not touched: the import still merges the FP8
    ones into ``Fp8Experts`` as before."""
    from tests.serialization.moe_fixtures import tiny_qwen3_moe, write_fp8_block_checkpoint

    written = write_fp8_block_checkpoint(tiny_qwen3_moe(), tmp_path / "fp8")
    back = _weights(import_checkpoint(tmp_path / "fp8", tmp_path / "back"))
    merged = back["model.layers.0.mlp.experts.down_proj"]
    assert merged.dtype == torch.float8_e4m3fn
    want = written["model.layers.0.mlp.experts.1.down_proj.weight"]
    assert torch.equal(merged[1].view(torch.uint8), want.view(torch.uint8))
