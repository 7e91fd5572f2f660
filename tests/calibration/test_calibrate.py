"""calibrate(): static scales from data, each observer, mode restored, saved and reloaded."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8 import Fp8Config, Fp8Linear
from tests.tiny_models import model_inputs

BATCHES = [model_inputs("llama", seed=s) for s in range(4)]


def _static(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=Fp8Config("static")
    )


def _reference_input_amax(tiny_model_dir) -> dict[str, float]:
    """max |x| seen by each linear of the *unquantized* model (the calibration forward runs
    activations in high precision, so the inputs are those of the original model up to the
    FP8 weights; compare with a tolerance)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama")).eval()
    seen: dict[str, float] = {}
    hooks = [
        m.register_forward_pre_hook(
            lambda _m, args, n=name: seen.__setitem__(
                n, max(seen.get(n, 0.0), float(args[0].abs().max()))
            )
        )
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name != "lm_head"
    ]
    with torch.no_grad():
        for batch in BATCHES:
            model(**batch)
    for h in hooks:
        h.remove()
    return seen


def test_minmax_scales_match_reference_amax(tiny_model_dir):
    model = _static(tiny_model_dir)
    scales = hf_fp8.calibrate(model, BATCHES, observer="minmax", progress=False)
    reference = _reference_input_amax(tiny_model_dir)
    assert scales.keys() == reference.keys()
    for name, amax in reference.items():
        assert scales[name] == pytest.approx(amax / 448, rel=0.05), name
        assert float(model.get_submodule(name).input_scale) == scales[name]


def test_observers_order_and_outputs(tiny_model_dir):
    results = {}
    for observer in ("minmax", "moving_average", "percentile", "mse"):
        model = _static(tiny_model_dir)
        results[observer] = hf_fp8.calibrate(model, BATCHES, observer=observer, progress=False)
        logits = model(**BATCHES[0]).logits
        assert torch.isfinite(logits).all()
    for name, top in results["minmax"].items():
        # no observer exceeds the absolute maximum; clipping observers stay below it
        assert results["moving_average"][name] <= top * (1 + 1e-6)
        assert results["percentile"][name] <= top * (1 + 1e-6)
        assert results["mse"][name] <= top * (1 + 1e-6)


def test_progress_bar_and_mode_restored(tiny_model_dir, capsys):
    model = _static(tiny_model_dir)
    model.train()
    hf_fp8.calibrate(model, BATCHES, progress=True)
    assert model.training
    assert "calibrating" in capsys.readouterr().err
    model.eval()
    hf_fp8.calibrate(model, iter(BATCHES), progress=False)  # a generator works too
    assert not model.training
    assert all(m.activation_scheme == "static" for m in model.modules() if isinstance(m, Fp8Linear))


def test_calibrated_scales_are_saved_and_reloaded(tiny_model_dir, tmp_path):
    model = _static(tiny_model_dir)
    hf_fp8.calibrate(model, BATCHES, observer="percentile", progress=False)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, m in model.named_modules():
        if isinstance(m, Fp8Linear):
            assert torch.equal(reloaded.get_submodule(name).input_scale, m.input_scale)
    assert torch.equal(reloaded(**BATCHES[0]).logits, model(**BATCHES[0]).logits)


def test_errors(tiny_model_dir):
    dynamic = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=Fp8Config("dynamic")
    )
    with pytest.raises(ValueError, match="Fp8Config\\('static'\\)"):
        hf_fp8.calibrate(dynamic, BATCHES)
    with pytest.raises(ValueError, match="minmax"):
        hf_fp8.calibrate(_static(tiny_model_dir), BATCHES, observer="histogram")
    with pytest.raises(ValueError, match="got no batches"):
        hf_fp8.calibrate(_static(tiny_model_dir), [], progress=False)
    with pytest.raises(ValueError, match="got no batches"):
        hf_fp8.calibrate(_static(tiny_model_dir), iter([]), progress=False)


# -- what calibrate accepts (issue 13: one batch, a list of batches, a DataLoader) -------------


def _scales(tiny_model_dir, batches, **kwargs):
    return hf_fp8.calibrate(_static(tiny_model_dir), batches, progress=False, **kwargs)


def test_one_batch_dict_batchencoding_or_tensor(tiny_model_dir):
    from transformers import BatchEncoding

    reference = _scales(tiny_model_dir, [BATCHES[0]])  # a list of one batch
    assert _scales(tiny_model_dir, BATCHES[0]) == reference  # the batch itself
    assert _scales(tiny_model_dir, BatchEncoding(BATCHES[0])) == reference  # a tokenizer's output
    # a tensor of token ids is one batch too (all-ones mask: same activations)
    assert _scales(tiny_model_dir, BATCHES[0]["input_ids"]) == reference


def test_dataloader_equals_the_list_of_its_batches(tiny_model_dir):
    rows = [
        {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        for batch in BATCHES
        for ids in batch["input_ids"]
    ]
    loader = torch.utils.data.DataLoader(rows, batch_size=2)
    assert _scales(tiny_model_dir, loader) == _scales(tiny_model_dir, list(loader))
    assert _scales(tiny_model_dir, list(loader)) == _scales(tiny_model_dir, BATCHES)


@pytest.mark.parametrize(
    ("batches", "error", "pattern"),
    [
        (["a text", "another"], TypeError, r"list of strings.*tokenize"),
        ("a text", TypeError, r"string.*tokenize"),
        ([["a text"], ["b"]], TypeError, r"batch 0 .*strings.*tokenize"),
        ({"input_ids": [[1, 2, 3]]}, TypeError, r"input_ids.*list.*return_tensors='pt'"),
        (42, TypeError, r"one batch .*list of batches.*DataLoader.*got int"),
        ([1, 2, 3], TypeError, r"batch 0 is int"),
        # (input_ids, attention_mask) ran the mask as a second batch of token ids, silently
        (
            (BATCHES[0]["input_ids"], BATCHES[0]["attention_mask"]),
            TypeError,
            r"tuple of 2 tensors.*\{'input_ids': .*'attention_mask'.*"
            r"\[\(input_ids, attention_mask\)\].*several batches: a list of such batches",
        ),
        # the same as a list ran the mask as a second batch of token ids, silently, too
        (
            [BATCHES[0]["input_ids"], BATCHES[0]["attention_mask"]],
            TypeError,
            r"item 1 of the list looks like the attention mask of item 0 .*\(2, 12\).*0/1.*"
            r"\{'input_ids': .*'attention_mask'.*\[\(input_ids, attention_mask\)\]",
        ),
        (  # a boolean mask, after a first batch given as a dict
            [BATCHES[1], BATCHES[0]["input_ids"], BATCHES[0]["attention_mask"].bool()],
            TypeError,
            r"item 2 of the list looks like the attention mask of item 1",
        ),
    ],
)
def test_what_it_cannot_use_is_named(batches, error, pattern, tiny_model_dir):
    with pytest.raises(error, match=pattern):
        _scales(tiny_model_dir, batches)


def test_a_list_of_token_id_tensors_is_still_a_list_of_batches(tiny_model_dir):
    """Same-shape batches of token ids (not 0/1 only) run as batches, as documented."""
    ids = [batch["input_ids"] for batch in BATCHES]
    assert _scales(tiny_model_dir, ids) == _scales(tiny_model_dir, BATCHES)


def test_the_forms_the_tuple_error_suggests_work(tiny_model_dir):
    """One batch of positional inputs in a list, or the same inputs as a dict: same scales."""
    ids, mask = BATCHES[0]["input_ids"], BATCHES[0]["attention_mask"]
    reference = _scales(tiny_model_dir, [BATCHES[0]])
    assert _scales(tiny_model_dir, [(ids, mask)]) == reference
    assert _scales(tiny_model_dir, {"input_ids": ids, "attention_mask": mask}) == reference


# -- layers without usable activations, non-finite activations ---------------------------------


class _Branches(torch.nn.Module):
    """``a`` sees x, ``zero`` sees only zeros, ``idle`` sees no token (or never runs)."""

    def __init__(self, empty_call: bool) -> None:
        super().__init__()
        config = Fp8Config("static")
        torch.manual_seed(0)
        for name in ("a", "zero", "idle"):
            linear = torch.nn.Linear(16, 16)
            setattr(self, name, Fp8Linear.from_linear(linear, config, module_name=name))
        self.empty_call = empty_call

    def forward(self, x):
        out = self.a(x) + self.zero(torch.zeros_like(x))
        if self.empty_call:
            out = out + self.idle(x[:0]).sum()
        return out


@pytest.mark.parametrize("empty_call", [True, False])
def test_uninformative_layers_fall_back_with_one_warning(empty_call):
    model = _Branches(empty_call)
    x = torch.randn(8, 16) * 3
    with pytest.warns(UserWarning) as record:
        scales = hf_fp8.calibrate(model, [x], progress=False)
    ours = [w for w in record if "calibrat" in str(w.message)]
    assert len(ours) == 1
    message = str(ours[0].message)
    assert "2 of 3" in message and "zero" in message and "idle" in message
    assert "saw only zeros" in message and "saw no tokens" in message
    # the fallback is the largest calibrated scale (only `a` was calibrated): x's max / 448
    expected = float(x.abs().max()) / 448
    assert scales["a"] == pytest.approx(expected, rel=1e-6)
    assert scales["zero"] == scales["idle"] == scales["a"]
    # at inference the fallback layer does not saturate (2.2e-15 did: rel. error 0.93)
    zero = model.zero
    reference = torch.nn.functional.linear(x, zero.dequantize_weight(torch.float32), zero.bias)
    with torch.no_grad():
        rel = float((zero(x) - reference).norm() / reference.norm())
    assert rel < 0.05


def test_fallback_keeps_a_configured_scale():
    model = _Branches(empty_call=True)
    model.idle.set_input_scale(0.125)
    with pytest.warns(UserWarning, match="idle"):
        scales = hf_fp8.calibrate(model, [torch.randn(4, 16)], progress=False)
    assert scales["idle"] == 0.125 and float(model.idle.input_scale) == 0.125


def test_no_informative_layer_at_all_is_an_error():
    model = _Branches(empty_call=True)
    with pytest.raises(ValueError, match="no static layer saw a nonzero activation"):
        hf_fp8.calibrate(model, [torch.zeros(4, 16)], progress=False)


def test_an_inf_activation_names_the_layer():
    model = _Branches(empty_call=True)
    x = torch.randn(8, 16)
    x[3, 5] = float("inf")
    with pytest.warns(UserWarning) as record:  # this one, and the fallback of zero / idle
        scales = hf_fp8.calibrate(model, [x], progress=False)
    nonfinite = [str(w.message) for w in record if "non-finite" in str(w.message)]
    assert len(nonfinite) == 1 and "1 static layer(s)" in nonfinite[0]
    assert ": a (1 value(s))" in nonfinite[0]
    assert all(w.filename == __file__ for w in record)  # points at the caller
    finite = x[torch.isfinite(x)]
    assert scales["a"] == pytest.approx(float(finite.abs().max()) / 448, rel=1e-6)
