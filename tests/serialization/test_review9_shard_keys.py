"""A tensor stored in two shards, or in a shard the index does not name for it (R14 2), is
refused by every route that reads an FP8 folder (pre-quantized ``from_pretrained``, inspect,
export, import, push), naming the tensor and both files. Before, the loader kept the last
copy read (x4 scale: logits 0.23 off the checkpoint the index describes) and export wrote an
index naming the copy."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8 import Fp8Config
from hf_fp8.serialization.checkpoint import Checkpoint, rewrite_tensors
from hf_fp8.utils.folders import ShardKeyError, check_loaded_keys, check_shard_keys
from tests.tiny_models import model_inputs, model_output

KEY = "model.layers.0.mlp.down_proj.weight_scale"
INDEX = "model.safetensors.index.json"


def _sharded(tiny_model_dir, path: Path) -> tuple[str, torch.Tensor]:
    """A sharded hf_fp8 save of the tiny Llama, and its logits."""
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=Fp8Config("dynamic")
    )
    model.save_pretrained(path, max_shard_size="20KB")
    assert (path / INDEX).is_file()
    return str(path), model_output(model, model_inputs("llama"))


def _weight_map(path) -> dict[str, str]:
    return json.loads((Path(path) / INDEX).read_text())["weight_map"]


def _other_shard(path, key: str = KEY) -> tuple[str, str]:
    weight_map = _weight_map(path)
    home = weight_map[key]
    return home, max(f for f in set(weight_map.values()) if f != home)


def _add_copy(path, key: str = KEY, *, move: bool = False) -> tuple[str, str]:
    """A x4 copy of ``key`` in another shard (``move``: taken out of the one the index names)."""
    home, other = _other_shard(path, key)
    home_tensors = load_file(f"{path}/{home}")
    tensors = load_file(f"{path}/{other}")
    tensors[key] = home_tensors[key] * 4
    save_file(tensors, f"{path}/{other}", metadata={"format": "pt"})
    if move:
        del home_tensors[key]
        save_file(home_tensors, f"{path}/{home}", metadata={"format": "pt"})
    return home, other


@pytest.fixture(scope="module")
def saved(tiny_model_dir, tmp_path_factory):
    return _sharded(tiny_model_dir, tmp_path_factory.mktemp("ck"))


def _copy_of(saved_path: str, tmp_path: Path) -> str:
    dst = tmp_path / "ck"
    dst.mkdir()
    for name in os.listdir(saved_path):
        (dst / name).write_bytes(Path(saved_path, name).read_bytes())
    return str(dst)


def test_intact_sharded_checkpoint_loads_exactly(saved):
    path, reference = saved
    model = AutoModelForCausalLM.from_pretrained(path)
    assert torch.equal(model_output(model, model_inputs("llama")), reference)
    assert hf_fp8.inspect_checkpoint(path).fp8_layers


@pytest.mark.parametrize("move", [False, True], ids=["copy", "moved"])
def test_from_pretrained_refuses(saved, tmp_path, move):
    path = _copy_of(saved[0], tmp_path)
    home, other = _add_copy(path, move=move)
    with pytest.raises(ShardKeyError) as err:
        AutoModelForCausalLM.from_pretrained(path)
    text = str(err.value)
    assert KEY in text and other in text and (home in text) and INDEX in text


@pytest.mark.parametrize("move", [False, True], ids=["copy", "moved"])
def test_inspect_export_and_push_refuse(saved, tmp_path, move, monkeypatch):
    path = _copy_of(saved[0], tmp_path)
    home, other = _add_copy(path, move=move)
    for read in (
        lambda: hf_fp8.inspect_checkpoint(path),
        lambda: hf_fp8.export(path, tmp_path / "ct"),
    ):
        with pytest.raises(ShardKeyError, match=KEY) as err:
            read()
        assert home in str(err.value) and other in str(err.value)
    assert not (tmp_path / "ct").exists()

    from transformers.utils import hub as hf_hub

    from hf_fp8.hub import push_folder

    def no_hub():
        raise AssertionError("push reached the Hub with an ambiguous checkpoint")

    monkeypatch.setattr(hf_hub, "hf_api", no_hub)
    with pytest.raises(ShardKeyError, match=KEY):
        push_folder(path, "me/model")


def test_cli_inspect_and_export_refuse(saved, tmp_path, capsys):
    from hf_fp8.cli import main

    path = _copy_of(saved[0], tmp_path)
    _home, other = _add_copy(path)
    assert main(["inspect", path]) != 0
    assert main(["export", path, "--out", str(tmp_path / "ct")]) != 0
    err = capsys.readouterr().err
    assert err.count(KEY) == 2 and other in err
    assert not (tmp_path / "ct").exists()


def test_import_refuses(saved, tmp_path):
    ct = tmp_path / "ct"
    hf_fp8.export(saved[0], ct)
    assert (ct / INDEX).is_file()
    _home, other = _add_copy(ct)
    with pytest.raises(ShardKeyError, match=KEY) as err:
        hf_fp8.import_checkpoint(ct, tmp_path / "back")
    assert other in str(err.value)
    assert not (tmp_path / "back").exists()


def test_rewrite_never_keeps_the_last_copy(saved, tmp_path):
    """Export's shard writer, reached without ``tensors()``: refuses, never lets a file win."""
    path = _copy_of(saved[0], tmp_path)
    _add_copy(path)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ShardKeyError, match=KEY):
        rewrite_tensors(Checkpoint(path), out, lambda shard: shard)


def _save_shards(folder: Path, shards: dict[str, dict[str, torch.Tensor]], weight_map) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, tensors in shards.items():
        if name.endswith(".bin"):
            torch.save(tensors, folder / name)
        else:
            save_file(tensors, str(folder / name), metadata={"format": "pt"})
    kind = "pytorch_model.bin" if next(iter(shards)).endswith(".bin") else "model.safetensors"
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / f"{kind}.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("ext", ["safetensors", "bin"])
def test_loaded_keys_of_absolute_files(tmp_path, ext):
    """What the quantizer checks for a Hub id (files in the cache, no local root): the index
    next to the shards; ``.bin`` shards through the capped torch header reader."""
    a, b = f"a.{ext}", f"b.{ext}"
    x, y = torch.ones(2), torch.zeros(3)
    _save_shards(tmp_path / "ok", {a: {"x": x}, b: {"y": y}}, {"x": a, "y": b})
    check_loaded_keys([tmp_path / "ok" / a, tmp_path / "ok" / b])
    _save_shards(tmp_path / "dup", {a: {"x": x}, b: {"x": x, "y": y}}, {"x": a, "y": b})
    with pytest.raises(ShardKeyError, match=rf"x is stored in two files .*{a} and {b}"):
        check_loaded_keys([tmp_path / "dup" / a, tmp_path / "dup" / b])
    moved = {a: {"w": x}, b: {"x": x, "y": y}}
    _save_shards(tmp_path / "moved", moved, {"w": a, "x": a, "y": b})
    with pytest.raises(ShardKeyError, match=rf"x is stored in {b} .* names {a} for it"):
        check_loaded_keys([tmp_path / "moved" / a, tmp_path / "moved" / b])


def test_unlisted_key_is_refused():
    with pytest.raises(ShardKeyError, match=r"z is stored in b\.safetensors .* does not list it"):
        check_shard_keys({"a.safetensors": ["x"], "b.safetensors": ["z"]}, {"x": "a.safetensors"})


def test_many_shards_read_headers_only(tmp_path):
    """512 shards of 8 tensors (32 KB of data each): the check reads headers, not data."""
    shards, weight_map = {}, {}
    for i in range(512):
        name = f"model-{i:05d}-of-00512.safetensors"
        shards[name] = {f"l{i}.t{j}": torch.zeros(1024) for j in range(8)}
        weight_map.update(dict.fromkeys(shards[name], name))
    _save_shards(tmp_path, shards, weight_map)
    files = [tmp_path / name for name in shards]
    start = time.thread_time()
    check_loaded_keys(files, root=tmp_path)
    cpu = time.thread_time() - start
    assert cpu < 2.0, f"{cpu:.2f} s of CPU for 512 shard headers"


def test_hub_id_load_refuses(saved, tmp_path, monkeypatch):
    """The same folder, loaded by repo id from the Hub cache (offline)."""
    import huggingface_hub.constants

    cache = tmp_path / "cache"
    commit = "0" * 40
    snapshot = cache / "models--me--tiny" / "snapshots" / commit
    snapshot.parent.mkdir(parents=True)
    (cache / "models--me--tiny" / "refs").mkdir()
    (cache / "models--me--tiny" / "refs" / "main").write_text(commit)
    (cache / "models--me--tiny" / "blobs").mkdir()
    path = _copy_of(saved[0], tmp_path)
    _add_copy(path)
    os.rename(path, snapshot)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ShardKeyError, match=KEY):
        AutoModelForCausalLM.from_pretrained("me/tiny", cache_dir=cache)


def test_online_hub_headers_refuse_a_tensor_in_two_shards(tmp_path, monkeypatch):
    """``hub_headers`` online (``hf-fp8 inspect`` of a repo id) builds its headers from the
    Hub's safetensors metadata: a tensor listed in two shards is refused there too, instead of
    the last shard's entry winning; the same metadata without the copy is read as before."""
    from types import SimpleNamespace

    import huggingface_hub
    import huggingface_hub.constants

    from hf_fp8.serialization import remote

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    info = SimpleNamespace(dtype="F8_E4M3", shape=[4, 4])
    scale = SimpleNamespace(dtype="F32", shape=[4, 1])

    def metadata(copy: bool) -> SimpleNamespace:
        second = {"b.weight": info, **({"a.weight": info} if copy else {})}
        files = {
            "model-1.safetensors": SimpleNamespace(tensors={"a.weight": info, "a.s": scale}),
            "model-2.safetensors": SimpleNamespace(tensors=second),
        }
        weight_map = {
            "a.weight": "model-1.safetensors",
            "a.s": "model-1.safetensors",
            "b.weight": "model-2.safetensors",
        }
        return SimpleNamespace(files_metadata=files, weight_map=weight_map)

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(
        huggingface_hub, "hf_hub_download", lambda *a, **k: str(tmp_path / "config.json")
    )
    answer = {}
    monkeypatch.setattr(
        huggingface_hub.HfApi, "get_safetensors_metadata", lambda self, *a, **k: answer["meta"]
    )
    answer["meta"] = metadata(copy=False)
    headers = remote.hub_headers("me/tiny").headers
    assert headers["a.weight"].file == "model-1.safetensors"
    answer["meta"] = metadata(copy=True)
    with pytest.raises(ShardKeyError, match=r"a\.weight") as err:
        remote.hub_headers("me/tiny")
    assert "model-1.safetensors" in str(err.value) and "model-2.safetensors" in str(err.value)


# -- R16 1: a .bin shard whose names cannot be read cheaply no longer skips the whole check --


def _as_bin(saved_path: str, dst: Path, *, legacy: str | None = None, pad: int = 0) -> Path:
    """The sharded save as ``pytorch_model-*.bin`` shards and their index; ``legacy``: the
    shard written in torch's legacy (non-zip) format; ``pad``: a tensor name of that many
    characters in the first shard (its pickle then exceeds the header reader's cap)."""
    dst.mkdir()
    for name in ("config.json", "generation_config.json"):
        (dst / name).write_bytes(Path(saved_path, name).read_bytes())
    weight_map = {}
    shards = sorted(set(_weight_map(saved_path).values()))
    for i, shard in enumerate(shards):
        tensors = load_file(f"{saved_path}/{shard}")
        name = _bin_name(shard)
        weight_map.update(dict.fromkeys(tensors, name))
        if pad and i == 0:
            tensors["zz." + "x" * pad] = torch.zeros(1)
        torch.save(tensors, dst / name, _use_new_zipfile_serialization=name != legacy)
    (dst / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return dst


def _bin_copy(folder: Path, key: str = KEY) -> str:
    """A x2 copy of ``key`` in another (zip-format) .bin shard; returns that shard."""
    home, other = _bin_other(folder, key)
    tensors = torch.load(folder / other, weights_only=True)
    tensors[key] = torch.load(folder / home, weights_only=True)[key] * 2
    torch.save(tensors, folder / other)
    return other


def _bin_other(folder: Path, key: str) -> tuple[str, str]:
    weight_map = json.loads((folder / "pytorch_model.bin.index.json").read_text())["weight_map"]
    home = weight_map[key]
    return home, max(f for f in set(weight_map.values()) if f != home)


def _bin_name(shard: str) -> str:
    return shard.replace("model-", "pytorch_model-").replace(".safetensors", ".bin")


def _first_bin(saved_path: str) -> str:
    return _bin_name(min(set(_weight_map(saved_path).values())))


@pytest.mark.parametrize("unreadable", ["legacy", "big_pickle"])
def test_bin_duplicate_refused_next_to_an_unreadable_shard(saved, tmp_path, unreadable):
    """R16 1: one shard in torch's legacy format (or with a pickle over 8 MiB) made the check
    return at once; the x2 copy in two readable shards loaded (scale exactly 2x)."""
    first = _first_bin(saved[0])
    kw = {"legacy": first} if unreadable == "legacy" else {"pad": 9 * 2**20}
    folder = _as_bin(saved[0], tmp_path / "bin", **kw)
    assert _bin_other(folder, KEY)[0] != first  # the copy is between readable shards
    other = _bin_copy(folder)
    with pytest.raises(ShardKeyError, match=KEY) as err:
        AutoModelForCausalLM.from_pretrained(folder)
    assert other in str(err.value)


def test_unreadable_bin_shard_of_a_prequantized_load_is_refused(saved, tmp_path):
    """A shard whose tensor names cannot be read is refused, named, with the fix (hf_fp8 and
    transformers 5.24 write safetensors; torch cannot store fp8 in the legacy format)."""
    first = _first_bin(saved[0])
    folder = _as_bin(saved[0], tmp_path / "bin", legacy=first)
    with pytest.raises(ShardKeyError, match="safetensors") as err:
        AutoModelForCausalLM.from_pretrained(folder)
    assert first in str(err.value)
    with pytest.raises(ShardKeyError, match=re.escape(first)):
        check_loaded_keys(sorted(folder.glob("*.bin")))


def test_zip_bin_shards_load_exactly(saved, tmp_path):
    """The same .bin shards, all readable and intact: loaded, logits equal the safetensors'."""
    folder = _as_bin(saved[0], tmp_path / "bin")
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert torch.equal(model_output(model, model_inputs("llama")), saved[1])


# -- R16 5: one shard spelled ``x`` and ``./x`` in the index is one file --


def _dot_slash(path: str, *, every: int = 2) -> None:
    index = json.loads((Path(path) / INDEX).read_text())
    for i, key in enumerate(sorted(index["weight_map"])):
        if i % every == 0:
            index["weight_map"][key] = "./" + index["weight_map"][key]
    (Path(path) / INDEX).write_text(json.dumps(index))


def test_dot_slash_spelling_of_a_shard_is_one_file(saved, tmp_path):
    """transformers loads an index naming a shard both ``x`` and ``./x``; inspect and export
    raised "stored in two files ./x and x" (R16 5). They read it as the plain index does."""
    path = _copy_of(saved[0], tmp_path)
    _dot_slash(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert torch.equal(model_output(model, model_inputs("llama")), saved[1])
    assert (
        hf_fp8.inspect_checkpoint(path).fp8_layers == hf_fp8.inspect_checkpoint(saved[0]).fp8_layers
    )
    plain = Checkpoint(saved[0])
    spelled = Checkpoint(path)
    assert spelled.files == plain.files and spelled.weight_map == plain.weight_map
    assert spelled.tensors() == plain.tensors()
    hf_fp8.export(path, tmp_path / "ct")
    hf_fp8.export(saved[0], tmp_path / "ct_plain")
    for name in plain.files:
        assert (
            load_file(tmp_path / "ct" / name).keys()
            == load_file(tmp_path / "ct_plain" / name).keys()
        )


def test_dot_slash_spelling_still_refuses_a_copy(saved, tmp_path):
    path = _copy_of(saved[0], tmp_path)
    _home, other = _add_copy(path)
    _dot_slash(path, every=1)
    with pytest.raises(ShardKeyError, match=KEY) as err:
        hf_fp8.inspect_checkpoint(path)
    assert other in str(err.value)
