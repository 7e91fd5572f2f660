"""push_to_hub / save_pretrained(push_to_hub=True) / push_folder against a local Hub stand-in."""

from __future__ import annotations

import copy
import gc
import json
import weakref

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors.torch import load as load_safetensors
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8.hub import push_folder, read_card_info
from hf_fp8.serialization.atomic import UnsafePathError
from tests.hub.fake_hub import cache_folder
from tests.serialization.helpers import quantized

REPO = "hf-fp8-tests/tiny-llama-fp8"
BASE = "hf-fp8-tests/tiny-llama"


def _base_from_cache(fake_hub, tiny_model_dir, scheme="dynamic"):
    """The tiny llama published as BASE in the stand-in's cache, loaded by repo id."""
    cache_folder(fake_hub.cache_dir, BASE, tiny_model_dir("llama"))
    return AutoModelForCausalLM.from_pretrained(BASE, quantization_config=hf_fp8.Fp8Config(scheme))


def _check_upload(files: dict[str, bytes], model) -> ModelCard:
    assert {"config.json", "model.safetensors", "README.md"} <= set(files)
    config = json.loads(files["config.json"])
    assert config["quantization_config"]["quant_method"] == "hf_fp8"
    tensors = load_safetensors(files["model.safetensors"])
    layer = "model.layers.0.mlp.up_proj"
    assert tensors[f"{layer}.weight"].dtype == torch.float8_e4m3fn
    assert torch.equal(tensors[f"{layer}.weight_scale"], model.get_submodule(layer).weight_scale)
    return ModelCard(files["README.md"].decode())


def test_push_to_hub_uploads_fp8_weights_config_and_card(fake_hub, tiny_model_dir):
    model = _base_from_cache(fake_hub, tiny_model_dir)
    hf_fp8.set_card_info(model, fidelity={"logits relative error": 0.02})
    model.push_to_hub(REPO, tags=["my-tag"])

    assert [c[0] for c in fake_hub.calls] == ["create_repo", "create_commit"]
    (commit,) = fake_hub.commits
    card = _check_upload(commit.files, model)
    assert card.data.library_name == "hf-fp8" and card.data.base_model == BASE
    assert card.data.base_model_relation == "quantized"
    assert {"fp8", "hf_fp8", "my-tag"} <= set(card.data.tags)
    assert (
        f'from_pretrained("{REPO}")' in card.text
        and "| logits relative error | 0.02 |" in card.text
    )


def test_save_pretrained_push_to_hub(fake_hub, tiny_model_dir, tmp_path):
    model = _base_from_cache(fake_hub, tiny_model_dir, "weight_only")
    out = tmp_path / "tiny-llama-fp8"
    model.save_pretrained(out, push_to_hub=True, repo_id=REPO)
    (commit,) = fake_hub.commits
    card = _check_upload(commit.files, model)
    assert (out / "README.md").read_text() == commit.files["README.md"].decode()
    assert read_card_info(card.text).scheme["activation_scheme"] == "weight_only"


def test_user_card_on_the_hub_is_kept(fake_hub, tiny_model_dir):
    model = _base_from_cache(fake_hub, tiny_model_dir)
    cache_folder_files = {"README.md": b"---\nlicense: mit\n---\n\n# Written by hand\n"}
    from tests.hub.fake_hub import write_snapshot

    write_snapshot(fake_hub.cache_dir, REPO, cache_folder_files)
    model.push_to_hub(REPO)
    card = ModelCard(fake_hub.commits[-1].files["README.md"].decode())
    assert card.text.strip() == "# Written by hand"
    assert card.data.license == "mit" and "hf_fp8" in card.data.tags


def test_push_folder_rerenders_the_saved_card_without_touching_the_folder(
    fake_hub, tiny_model_dir, tmp_path
):
    model = _base_from_cache(fake_hub, tiny_model_dir)
    folder = tmp_path / "fp8"
    model.save_pretrained(folder)
    saved = (folder / "README.md").read_text()
    (folder / ".cache").mkdir()
    (folder / ".cache" / "junk").write_text("x")
    assert fake_hub.calls == []  # saving is local

    push_folder(folder, REPO, revision="v1", commit_message="fp8")
    commit = fake_hub.commits[-1]
    assert (commit.revision, commit.message) == ("v1", "fp8")
    assert ".cache/junk" not in commit.files
    card = ModelCard(commit.files["README.md"].decode())
    assert f'from_pretrained("{REPO}")' in card.text and card.data.base_model == BASE
    assert (folder / "README.md").read_text() == saved


def test_push_folder_of_an_export_without_card(fake_hub, tiny_model_dir, tmp_path):
    model = quantized(tiny_model_dir("llama"), "dynamic-row-token")
    out = hf_fp8.export(model, tmp_path / "ct", model_card=False)
    assert not (out / "README.md").exists()
    push_folder(out, REPO, base_model=BASE)
    card = ModelCard(fake_hub.commits[-1].files["README.md"].decode())
    assert card.data.base_model == BASE and "compressed-tensors" in card.data.tags
    assert not (out / "README.md").exists()


def test_card_hooks_follow_deepcopy(fake_hub, tiny_model_dir, tmp_path):
    model = _base_from_cache(fake_hub, tiny_model_dir)
    twin = copy.deepcopy(model)
    twin.save_pretrained(tmp_path / "twin")
    assert read_card_info((tmp_path / "twin" / "README.md").read_text()).base_model == BASE
    assert fake_hub.calls == []


def test_card_hooks_do_not_keep_a_dropped_model_alive(fake_hub, tiny_model_dir):
    """Freed by reference counting alone (no cycle through the instance's methods)."""
    model = _base_from_cache(fake_hub, tiny_model_dir)
    ref = weakref.ref(model)
    gc.collect()
    gc.disable()
    try:
        del model
        assert ref() is None
    finally:
        gc.enable()


def test_card_on_a_chained_save_and_none_for_plain_models(fake_hub, tiny_model_dir, tmp_path):
    """``from_pretrained(...).save_pretrained(out)`` (the model is a temporary) writes the
    card; a model loaded without hf_fp8 in the same process gets none."""
    _base_from_cache(fake_hub, tiny_model_dir).save_pretrained(tmp_path / "fp8")
    assert read_card_info((tmp_path / "fp8" / "README.md").read_text()).base_model == BASE
    AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama")).save_pretrained(tmp_path / "hp")
    assert (tmp_path / "hp" / "config.json").exists()
    assert not (tmp_path / "hp" / "README.md").exists()


def test_push_folder_uses_upload_patterns(fake_hub, tiny_model_dir, tmp_path):
    folder = tmp_path / "fp8"
    _base_from_cache(fake_hub, tiny_model_dir).save_pretrained(folder)
    push_folder(folder, REPO, ignore_patterns=["generation_config.json"])
    assert ("upload_folder", REPO) in fake_hub.calls
    files = fake_hub.commits[-1].files
    assert "generation_config.json" not in files and (folder / "generation_config.json").exists()
    assert files["config.json"] == (folder / "config.json").read_bytes()
    assert read_card_info(files["README.md"].decode()).base_model == BASE


@pytest.mark.parametrize("what", ["file", "folder"])
def test_push_folder_refuses_symlinks(fake_hub, tiny_model_dir, tmp_path, what):
    folder = tmp_path / "fp8"
    _base_from_cache(fake_hub, tiny_model_dir).save_pretrained(folder)
    secret = tmp_path / "outside"
    secret.mkdir()
    (secret / "id_rsa").write_text("private key")
    if what == "file":
        (folder / "extra.bin").symlink_to(secret / "id_rsa")
    else:
        (folder / "extra").symlink_to(secret, target_is_directory=True)
    with pytest.raises(UnsafePathError, match="symlink"):
        push_folder(folder, REPO)
    assert fake_hub.calls == []  # refused before anything reached the Hub
