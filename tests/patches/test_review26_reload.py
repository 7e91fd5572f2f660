"""Review 26 finding 1: ``importlib.reload`` of a patch module (as IPython's ``%autoreload``
does after the file changes) broke every model in the process.

The wrappers looked transformers' methods up in a module-level ``_ORIGINAL`` dict that a
reload empties: ``model.dtype``, ``.half()`` and ``save_pretrained`` raised ``KeyError`` on
every model, hf_fp8's or not; re-applying a patch then wrapped its own wrapper
(``RecursionError``), and ``save_pretrained`` nested its temporary folders until the name was
too long. The originals now live in the wrappers, which are marked, and ``apply()`` finds
the mark on the class: a reload changes nothing. Subprocesses: reloading patches in the test
process would affect other tests."""

from __future__ import annotations

import json

from tests.patches.helpers import TINY_SETUP, check, run_python

RELOAD = (
    """
import importlib, json, os, sys, tempfile
import torch
import transformers as tf
from transformers import AutoModelForCausalLM, PreTrainedModel
import hf_fp8
from hf_fp8.quantizer import hf_quantizer

tmp = tempfile.mkdtemp()
HP = os.path.join(tmp, "hp")
"""
    + TINY_SETUP
    + """
def patchtst(folder):
    torch.manual_seed(0)
    cfg = tf.PatchTSTConfig(
        num_input_channels=3, context_length=32, patch_length=8, patch_stride=8, d_model=64,
        num_hidden_layers=1, num_attention_heads=4, ffn_dim=128,
    )
    tf.PatchTSTModel(cfg).eval().save_pretrained(folder)
    return tf.PatchTSTModel.from_pretrained(folder, quantization_config=hf_fp8.Fp8Config("dynamic"))

def fp8_load():
    return AutoModelForCausalLM.from_pretrained(HP, quantization_config=hf_fp8.Fp8Config("dynamic"))

plain = AutoModelForCausalLM.from_pretrained(HP)
fp8 = fp8_load()  # wraps save_pretrained (model_card patch, first hf_fp8 load)
tst = patchtst(os.path.join(tmp, "tst"))
names = ("compute_dtype", "model_dtype", "model_card", "fp8_without_config")
attrs = ("dtype", "half", "float", "save_pretrained", "_upload_modified_files",
         "_load_pretrained_model")
before = {a: PreTrainedModel.__dict__[a] for a in attrs}
hooks = len(hf_quantizer.POST_LOAD_HOOKS)

for name in filter(None, sys.argv[1].split(",")):
    if name == "patches":
        importlib.reload(sys.modules["hf_fp8.patches"])
    else:
        importlib.reload(sys.modules["hf_fp8.patches." + name])
for name in names:  # re-applying (the next import trigger, or by hand) changes nothing
    assert hf_fp8.patches.apply(name, strict=True), name
fp8_after = fp8_load()  # the next hf_fp8 load re-runs the model_card step

out = {}
out["same_wrappers"] = [a for a in attrs if PreTrainedModel.__dict__[a] is not before[a]]
out["hooks_added"] = len(hf_quantizer.POST_LOAD_HOOKS) - hooks
out["status"] = {n: s for n, s in hf_fp8.patches.status().items() if n in names}
out["plain_dtype"] = str(plain.dtype)
out["plain_first_param"] = str(next(plain.parameters()).dtype)
out["tst_dtype"] = str(tst.dtype)
plain.half()
out["plain_half"] = sorted({str(p.dtype) for p in plain.parameters()})
plain.float()
out["plain_float"] = sorted({str(p.dtype) for p in plain.parameters()})
fp8.half()
out["fp8_half_compute"] = sorted({str(m.compute_dtype) for m in fp8.modules()
                                  if isinstance(m, hf_fp8.Fp8Linear)})
for i, model in enumerate((fp8, fp8_after)):
    dst = os.path.join(tmp, f"saved{i}")
    model.save_pretrained(dst)
    out[f"saved{i}"] = sorted(os.listdir(dst))
out["leftovers"] = [f for f in os.listdir(tmp) if "tmp" in f]
back = AutoModelForCausalLM.from_pretrained(os.path.join(tmp, "saved1"))
out["reloaded_fp8_layers"] = sum(isinstance(m, hf_fp8.Fp8Linear) for m in back.modules())
# an FP8 folder without its quantization_config is still refused, once
cfg_path = os.path.join(tmp, "saved1", "config.json")
cfg = json.load(open(cfg_path)); del cfg["quantization_config"]; json.dump(cfg, open(cfg_path, "w"))
from unittest import mock
from hf_fp8.quantizer import lost_config
with mock.patch.object(lost_config, "check_fp8_has_config",
                       wraps=lost_config.check_fp8_has_config) as spy:
    try:
        AutoModelForCausalLM.from_pretrained(os.path.join(tmp, "saved1"))
        out["lost_config"] = "loaded"
    except Exception as exc:
        out["lost_config"] = type(exc).__name__
    AutoModelForCausalLM.from_pretrained(HP)  # checked (and passes) once per load
    out["lost_config_checks"] = spy.call_count
print("OUT", json.dumps(out))
"""
)


def _run(reloaded: str) -> dict:
    code = f"import sys; sys.argv = ['x', {reloaded!r}]\n" + RELOAD
    out = check(run_python(code, timeout=600))
    line = next(ln for ln in out.splitlines() if ln.startswith("OUT "))
    return json.loads(line[4:])


def _check_unchanged(out: dict) -> None:
    assert out["same_wrappers"] == []  # no attribute re-wrapped
    assert out["hooks_added"] == 0  # the card marker is not added twice
    assert set(out["status"].values()) == {"on"}, out["status"]
    # plain transformers: dtype is the first parameter's, half / float cast every parameter
    assert out["plain_dtype"] == out["plain_first_param"] == "torch.float32"
    assert out["plain_half"] == ["torch.float16"]
    assert out["plain_float"] == ["torch.float32"]
    # hf_fp8 models: the compute dtype (the high-precision PatchTST's float32), .half() as .to
    assert out["tst_dtype"] == "torch.float32"
    assert out["fp8_half_compute"] == ["torch.float16"]
    for key in ("saved0", "saved1"):
        assert "README.md" in out[key] and "config.json" in out[key], out[key]
        assert not [f for f in out[key] if "tmp" in f], out[key]
    assert out["leftovers"] == []
    assert out["reloaded_fp8_layers"] > 0
    assert out["lost_config"] == "CheckpointTensorError"
    assert out["lost_config_checks"] == 2  # two loads, wrapped once: one check each


def test_reload_of_every_patch_module_and_the_package():
    out = _run(",".join(("model_card", "model_dtype", "compute_dtype",
                         "fp8_without_config", "patches")))  # fmt: skip
    assert out["same_wrappers"] == [] and out["hooks_added"] == 0  # nothing wrapped twice
    _check_unchanged(out)


def test_reload_of_nothing_is_the_reference():
    """The same checks without a reload: what the patched process does."""
    out = _run("")
    assert set(out["status"].values()) == {"on"}, out["status"]
    _check_unchanged(out)
