"""R23 F2: HRM-text's config says num_hidden_layers = layers per stack x H_cycles x
(L_cycles + 1) (128 by default) while each stack stores 16 layers: the layer-count check
refused every standard HRM checkpoint in inspect / export / import, and its advice (set
num_hidden_layers to 16) broke the model's cache. Looped models reuse stored layers; the
check allows a count up to 16 x the stored layers + 64 and still refuses a config that
describes 20,000 layers for a 1-layer checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")


@pytest.mark.skipif(not hasattr(transformers, "HrmTextConfig"), reason="no HRM in transformers")
def test_a_looped_hrm_checkpoint_passes_the_layer_count_check(tmp_path, capsys) -> None:
    from hf_fp8 import Fp8Config, export
    from hf_fp8.cli import main

    cfg = transformers.HrmTextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=16,
        num_attention_heads=2, head_dim=32,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.HrmTextForCausalLM(cfg).save_pretrained(tmp_path / "base")
    saved = json.loads((tmp_path / "base" / "config.json").read_text())
    q = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "base", quantization_config=Fp8Config("dynamic")
    )
    q.save_pretrained(tmp_path / "fp8")
    capsys.readouterr()
    assert saved["num_hidden_layers"] > 16 + 64  # the looped count the config saves
    assert main(["inspect", "--json", str(tmp_path / "fp8")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "num_hidden_layers" not in json.dumps(report), report
    # export goes past the layer count (it refuses HRM's renamed gqkv_proj instead)
    with pytest.raises(ValueError, match="gqkv_proj") as refused:
        export(tmp_path / "fp8", tmp_path / "ct", "compressed-tensors")
    assert "num_hidden_layers" not in str(refused.value)


def test_a_config_far_beyond_the_stored_layers_is_still_refused() -> None:
    from hf_fp8.serialization.layers import check_layer_counts

    names = [f"model.layers.0.mlp.{p}.weight" for p in ("up_proj", "down_proj")]
    with pytest.raises(ValueError, match="num_hidden_layers is 20000"):
        check_layer_counts({"num_hidden_layers": 20000}, names)
    check_layer_counts({"num_hidden_layers": 80}, names)  # 16 x 1 + 64: still built
