"""The granularity refusal names a block size only when the stored scale shapes of the whole
checkpoint determine it (R12 F1). A block that does not divide a dimension leaves a range of
sizes giving the same shapes: the refusal advised ``ceil(dim / count)`` (96 / 2 -> 48), and
following it loaded a model 7.5% off with no error."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file

from hf_fp8 import Fp8Config
from hf_fp8.numerics.checks import CheckpointTensorError
from hf_fp8.quantizer.scale_granularity import block_advice, block_range
from hf_fp8.quantizer.validation import check_weight_scale_shape

IDS = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(1))


def _saved(
    tmp_path,
    block,
    *,
    hidden=96,
    intermediate=96,
    heads=3,
    kv=1,
    head_dim=32,
    edit=None,
    shard=None,
):
    """A tiny Llama quantized weight-only with ``block``, saved; its logits; the config path.
    ``edit``: the quantization_config's block_size after saving (``None``: removed, so it
    defaults to [128, 128]); ``shard``: save_pretrained's max_shard_size."""
    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    tf.LlamaForCausalLM(config).save_pretrained(tmp_path / "hp")
    fp8 = Fp8Config("weight_only", weight_granularity="block", block_size=list(block))
    model = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "hp", quantization_config=fp8)
    with torch.no_grad():
        reference = model(IDS).logits
    model.save_pretrained(tmp_path / "q", **({"max_shard_size": shard} if shard else {}))
    path = tmp_path / "q" / "config.json"
    data = json.loads(path.read_text())
    if edit is None:
        data["quantization_config"].pop("block_size")
    else:
        data["quantization_config"]["block_size"] = list(edit)
    path.write_text(json.dumps(data))
    return tmp_path / "q", reference


def _refusal(folder) -> str:
    with pytest.raises(CheckpointTensorError) as err:
        tf.AutoModelForCausalLM.from_pretrained(folder)
    return str(err.value)


def _follow(folder, text: str) -> torch.Tensor:
    """Set the block_size the refusal says to set, load, return the logits."""
    advised = re.search(r"block_size=\[(\d+), (\d+)\]: set that", text)
    assert advised, text
    path = folder / "config.json"
    data = json.loads(path.read_text())
    data["quantization_config"]["block_size"] = [int(advised[1]), int(advised[2])]
    path.write_text(json.dumps(data))
    with torch.no_grad():
        return tf.AutoModelForCausalLM.from_pretrained(folder)(IDS).logits


def test_block_range_matches_brute_force():
    for dim in range(1, 70):
        for count in range(1, dim + 2):
            fits = [b for b in range(1, 200) if math.ceil(dim / b) == count]
            lo, hi = block_range(dim, count)
            expected = [b for b in range(1, 200) if lo <= b <= hi]
            assert fits == expected, (dim, count)


def test_undetermined_block_is_not_advised(tmp_path):
    """R12's reproducer: 64 does not divide 96; 48..95 all give the same shapes."""
    folder, _ = _saved(tmp_path, (64, 64))
    text = _refusal(folder)
    assert "block_size=[48, 48]" not in text and "set that" not in text
    assert "do not determine" in text and "another block_size in 48..95 x 48..95" in text
    assert "the one the checkpoint was quantized with" in text
    assert "block_size=[64, 64] (the usual size that fits)" in text  # a hint only


def test_block_fixed_by_all_layers_is_advised_and_loads_identically(tmp_path):
    """Block 32 on 96 and 33 wide weights: 96 / 3 allows 32..47, 33 / 2 allows 17..32, so
    only the intersection over the layers fixes 32 (one layer alone would not)."""
    one_layer = block_advice([((96, 96), (3, 3))], (128, 128))
    assert one_layer is not None and not one_layer[1]
    folder, reference = _saved(tmp_path, (32, 32), intermediate=33)
    text = _refusal(folder)
    assert "weight_granularity='block', block_size=[32, 32]: set that" in text
    assert torch.equal(_follow(folder, text), reference)


def test_one_block_per_axis_is_advised_and_loads_identically(tmp_path):
    """Every weight fits in one block: any size >= 96 gives the same model; the advice
    (128, the usual size that fits) loads it identically."""
    folder, reference = _saved(tmp_path, (128, 128), edit=(64, 64))
    text = _refusal(folder)
    assert "weight_granularity='block', block_size=[128, 128]: set that" in text
    assert torch.equal(_follow(folder, text), reference)


def test_inconsistent_shapes_name_no_block():
    assert block_advice([((96, 96), (2, 2)), ((96, 96), (3, 3))], (128, 128)) is None


# -- R16 4: .bin and Hub-id loads read every layer's scale shape too, or claim nothing exact --


def _to_bin(folder: Path) -> list[str]:
    """Rewrite ``folder``'s safetensors weights as torch.save ``.bin`` files (an index for
    shards), as a user converting a checkpoint might; returns the .bin paths."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        names = {
            f: f.replace("model-", "pytorch_model-").replace(".safetensors", ".bin")
            for f in set(weight_map.values())
        }
        bin_map = {k: names[v] for k, v in weight_map.items()}
        (folder / "pytorch_model.bin.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": bin_map})
        )
        index.unlink()
    else:
        names = {"model.safetensors": "pytorch_model.bin"}
    for st, bin_name in names.items():
        torch.save(load_file(folder / st), folder / bin_name)
        (folder / st).unlink()
    return sorted(str(folder / b) for b in names.values())


@pytest.mark.parametrize("shard", [None, "20KB"], ids=["single", "sharded"])
def test_bin_checkpoint_advice_reads_every_layer(tmp_path, shard):
    """R16 4: on .bin the advice came from the refused layer alone and was called exact
    ([64, 128], then [128, 128] after another refusal). Read from every layer, it is the
    safetensors checkpoint's advice, and following it loads identically."""
    folder, reference = _saved(
        tmp_path, (128, 128), hidden=64, intermediate=128, heads=2, edit=(64, 64), shard=shard
    )
    _to_bin(folder)
    text = _refusal(folder)
    assert "weight_granularity='block', block_size=[128, 128]: set that" in text
    assert torch.equal(_follow(folder, text), reference)


def test_unreadable_other_layers_never_make_the_advice_exact(tmp_path):
    """A Hub id (no local folder) or unreadable shards: only the refused layer's shape is
    known, and a block that covers its whole axis may not cover another layer's."""
    folder, _ = _saved(tmp_path, (128, 128), hidden=64, intermediate=128, heads=2)
    recipe = Fp8Config("weight_only", weight_granularity="block", block_size=[64, 64]).recipe
    key = "model.layers.0.mlp.down_proj.weight_scale"
    args = (key, (1, 1), (64, 128), recipe)
    for kwargs in ({"root": "me/tiny"}, {"root": str(folder), "files": [str(folder / "nope.bin")]}):
        with pytest.raises(CheckpointTensorError) as err:
            check_weight_scale_shape(*args, **kwargs)
        assert "set that" not in str(err.value) and "do not determine" in str(err.value)
    files = _to_bin(folder)
    with pytest.raises(CheckpointTensorError, match=r"block_size=\[128, 128\]: set that"):
        check_weight_scale_shape(*args, root="me/tiny", files=files)


def test_hub_id_advice_reads_every_layer(tmp_path, monkeypatch):
    """The same checkpoint loaded by repo id from the Hub cache (offline): the quantizer's
    checkpoint files give every layer, so the advice is as exact as the local folder's."""
    import huggingface_hub.constants

    folder, _ = _saved(tmp_path, (128, 128), hidden=64, intermediate=128, heads=2, edit=(64, 64))
    cache, commit = tmp_path / "cache", "0" * 40
    repo = cache / "models--me--tiny"
    (repo / "snapshots").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (repo / "blobs").mkdir()
    folder.rename(repo / "snapshots" / commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CheckpointTensorError) as err:
        tf.AutoModelForCausalLM.from_pretrained("me/tiny", cache_dir=cache)
    assert "weight_granularity='block', block_size=[128, 128]: set that" in str(err.value)
