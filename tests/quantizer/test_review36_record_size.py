"""R36: the input-scale record of every shard was parsed with json.loads, however long (up to
safetensors' 100 MB header), and every shard's parsed set was kept: a hostile checkpoint cost
~8x its record size in memory per shard. A record longer than MAX_RECORD_CHARS is no record
(a partial checkpoint is then refused, as one without it), and the shards' raw texts are
compared before the one parse."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hf_fp8.numerics.checks import CheckpointTensorError
from hf_fp8.quantizer import input_scales
from tests.quantizer.test_gap12_hand_set_input_scales import _hand_set_llama


def _rewrite_record(folder, record: str) -> None:
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            metadata = dict(f.metadata())
        metadata[input_scales.RECORD_KEY] = record
        save_file(load_file(path), path, metadata=metadata)


def test_an_overlong_record_counts_as_none_and_the_partial_checkpoint_is_refused(
    tiny_model_dir, tmp_path, monkeypatch
):
    model = _hand_set_llama(tiny_model_dir)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    shard = sorted(tmp_path.glob("*.safetensors"))[0]
    with safe_open(str(shard), "pt") as f:
        record = f.metadata()[input_scales.RECORD_KEY]
    names = json.loads(record)
    # the same names padded with junk: still a list of strings, but longer than the bound
    padded = json.dumps(names + [f"junk.{i}" for i in range(2000)])
    monkeypatch.setattr(input_scales, "MAX_RECORD_CHARS", len(record) + 100)
    assert len(padded) > input_scales.MAX_RECORD_CHARS
    _rewrite_record(tmp_path, padded)
    parsed = []
    real_loads = input_scales.json.loads
    monkeypatch.setattr(
        input_scales.json, "loads", lambda text: parsed.append(len(text)) or real_loads(text)
    )
    with pytest.raises(CheckpointTensorError, match="lacks"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    assert len(padded) not in parsed  # the overlong record was never parsed


def test_the_record_is_parsed_once_for_all_shards(tiny_model_dir, tmp_path, monkeypatch):
    model = _hand_set_llama(tiny_model_dir)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    files = sorted(str(p) for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 1
    parsed = []
    real_loads = input_scales.json.loads
    monkeypatch.setattr(
        input_scales.json, "loads", lambda text: parsed.append(len(text)) or real_loads(text)
    )
    record = input_scales.saved_record(files)
    assert len(parsed) == 1
    with safe_open(files[0], "pt") as f:
        assert record == set(json.loads(f.metadata()[input_scales.RECORD_KEY]))
    assert record  # the hand-set scales are named
