"""The weight-read-directly rule, read from the parent's source: a linear whose parent
multiplies ``self.<child>.weight`` itself stays in high precision (Mamba's ``dt_proj`` was
converted, and its mixer then multiplied fp8 codes: "expected scalar type Float but found
Float8_e4m3fn")."""

from __future__ import annotations

import copy
import functools
import re

import pytest
import torch
import transformers as tf
from torch import nn

from hf_fp8 import Fp8Config, quantize_model
from hf_fp8.modules import Fp8Linear, convertible_modules, keep_reason


class _ReadsWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(8, 8)
        self.called = nn.Linear(8, 8)
        self.used.weight.data.zero_()  # reading in __init__ does not count

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.called(x) @ self.used.weight


def test_a_child_whose_weight_the_parent_reads_is_kept() -> None:
    model = nn.Sequential(_ReadsWeight())
    names = [n for n, _, _ in convertible_modules(model)]
    assert names == ["0.called"]
    parent = model[0]
    assert "reads its .weight directly" in keep_reason(parent.used, "0.used", parent=parent)


def test_mamba_loads_and_runs_in_fp8(tmp_path) -> None:
    torch.manual_seed(0)
    cfg = tf.MambaConfig(vocab_size=64, hidden_size=32, state_size=4, num_hidden_layers=2)
    ref = tf.MambaForCausalLM(cfg).eval()
    ref.save_pretrained(tmp_path)
    model = tf.AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=Fp8Config())
    mixer = model.backbone.layers[0].mixer
    assert isinstance(mixer.in_proj, Fp8Linear)
    assert type(mixer.dt_proj) is nn.Linear  # read as mixer.dt_proj.weight @ ...
    # called as modules on the CPU path, but the CUDA kernel branch passes their weights to
    # mamba_inner_fn: the saved model must run there too
    assert type(mixer.x_proj) is nn.Linear
    assert type(mixer.out_proj) is nn.Linear
    ids = torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
    assert float((got - want).norm() / want.norm()) < 0.1


class _CastsToWeightDtype(nn.Module):
    """T5's ``DenseActDense``: ``wo`` is called, but only after the input was cast to
    ``wo.weight.dtype`` under a condition (an FP8 weight: "Promotion for Float8 Types")."""

    def __init__(self) -> None:
        super().__init__()
        self.wi = nn.Linear(8, 16)
        self.wo = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.wi(x)
        if (
            isinstance(self.wo.weight, torch.Tensor)
            and h.dtype != self.wo.weight.dtype
            and self.wo.weight.dtype != torch.int8
        ):
            h = h.to(self.wo.weight.dtype)
        return self.wo(h)


class _InheritsTheRead(_CastsToWeightDtype):
    """A subclass that keeps its base's ``forward`` reads ``wo.weight`` all the same."""


class _ReadsInAHelper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def _weights(self, fast: bool) -> list[torch.Tensor]:
        out = []
        if fast:
            out.append(self.proj.weight)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def _logged(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


class _DecoratedForward(_CastsToWeightDtype):
    """A decorated forward (transformers' ``deprecate_kwarg``, Bamba's mixer): the wrapper's
    code reads nothing, the wrapped one does."""

    @_logged
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.wi(x)
        if h.dtype != self.wo.weight.dtype:
            h = h.to(self.wo.weight.dtype)
        return self.wo(h)


@pytest.mark.parametrize("cls", [_CastsToWeightDtype, _InheritsTheRead, _DecoratedForward])
def test_a_read_under_a_condition_or_inherited_keeps_the_child(cls) -> None:
    model = nn.Sequential(cls())
    assert [n for n, _, _ in convertible_modules(model)] == ["0.wi"]
    parent = model[0]
    assert "reads its .weight directly" in keep_reason(parent.wo, "0.wo", parent=parent)


def test_a_read_in_a_nested_expression_of_a_helper_keeps_the_child() -> None:
    assert convertible_modules(nn.Sequential(_ReadsInAHelper())) == []


def _dequantized(model: nn.Module) -> nn.Module:
    """The reference: the same model with every Fp8Linear replaced by its dequantized linear."""
    ref = copy.deepcopy(model)
    for name, module in list(ref.named_modules()):
        if isinstance(module, Fp8Linear):
            parent, _, child = name.rpartition(".")
            setattr(ref.get_submodule(parent) if parent else ref, child, module.dequantize())
    return ref


_T5_SIZES = dict(
    vocab_size=128,
    d_model=32,
    d_kv=8,
    d_ff=64,
    num_layers=2,
    num_heads=4,
    decoder_start_token_id=0,
)
T5_LIKE = {
    "t5": (tf.T5Config, tf.T5ForConditionalGeneration, {}),
    "longt5": (tf.LongT5Config, tf.LongT5ForConditionalGeneration, {}),
    "switch_transformers": (
        tf.SwitchTransformersConfig,
        tf.SwitchTransformersForConditionalGeneration,
        dict(num_experts=4, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1),
    ),
}


@pytest.fixture(scope="module")
def t5_like_dirs(tmp_path_factory) -> dict[str, str]:
    out = {}
    for family, (config_cls, model_cls, extra) in T5_LIKE.items():
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(family)
        model_cls(config_cls(**_T5_SIZES, **extra)).save_pretrained(path)
        out[family] = str(path)
    return out


@pytest.mark.parametrize("family", list(T5_LIKE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_t5_like_families_keep_wo_and_run(t5_like_dirs, family, dtype) -> None:
    """LongT5 / SwitchTransformers cast the feed-forward input to ``wo.weight.dtype`` under a
    condition: ``wo`` was converted and every forward raised. T5 kept it only through its
    ``_keep_in_fp32_modules``; the rule now keeps it in all three."""
    model_cls = T5_LIKE[family][1]
    model = model_cls.from_pretrained(
        t5_like_dirs[family], dtype=dtype, quantization_config=Fp8Config("weight_only")
    )
    wos = {type(m) for n, m in model.named_modules() if n.endswith(".wo")}
    assert wos == {nn.Linear}
    assert any(isinstance(m, Fp8Linear) for m in model.modules())
    ids = torch.randint(1, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "decoder_input_ids": ids[:, :5]}
    with torch.no_grad():
        got = model(**inputs).logits.float()
        want = _dequantized(model)(**inputs).logits.float()
    assert got.isfinite().all()
    assert float((got - want).norm() / want.norm()) < (0.02 if dtype == torch.bfloat16 else 1e-4)


class _FlagGated(nn.Module):
    """Bloom's ``slow_but_exact``: ``dense.weight`` is sliced only when the instance's own
    settings open the branch."""

    def __init__(self, tp: int, exact: bool) -> None:
        super().__init__()
        self.dense = nn.Linear(8, 8)
        self.pretraining_tp = tp
        self.slow_but_exact = exact

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pretraining_tp > 1 and self.slow_but_exact:
            return x @ self.dense.weight[:, :4].sum() + x
        return self.dense(x)


@pytest.mark.parametrize(
    ("tp", "exact", "kept"),
    [(1, False, False), (2, False, False), (1, True, False), (2, True, True)],
)
def test_a_branch_the_instance_settings_close_does_not_keep(tp, exact, kept) -> None:
    model = nn.Sequential(_FlagGated(tp, exact))
    assert (convertible_modules(model) == []) is kept


@pytest.mark.parametrize("exact", [False, True])
def test_bloom_converts_its_dense_layers_unless_slow_but_exact(tmp_path, exact) -> None:
    torch.manual_seed(0)
    config = tf.BloomConfig(
        vocab_size=128, hidden_size=32, n_layer=2, n_head=4, pretraining_tp=2,
        slow_but_exact=exact,
    )  # fmt: skip
    tf.BloomForCausalLM(config).save_pretrained(tmp_path)
    model = tf.AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=Fp8Config())
    block = model.transformer.h[0]
    assert isinstance(block.mlp.dense_h_to_4h, Fp8Linear)
    for layer in (block.self_attention.dense, block.mlp.dense_4h_to_h):
        assert (type(layer) is nn.Linear) is exact
    ids = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = model(ids).logits, _dequantized(model)(ids).logits
    assert float((got - want).norm() / want.norm()) < 0.05


class _TrainingGated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:  # a mode model.train() switches later: never closes the branch
            return x @ self.proj.weight
        return self.proj(x)


def test_the_training_mode_never_closes_a_branch() -> None:
    assert convertible_modules(nn.Sequential(_TrainingGated()).eval()) == []


@pytest.mark.parametrize(
    ("module", "cls", "child"),
    [
        ("t5", "T5DenseActDense", "wo"),
        ("t5", "T5DenseGatedActDense", "wo"),
        ("longt5", "LongT5DenseActDense", "wo"),
        ("switch_transformers", "SwitchTransformersDenseActDense", "wo"),
        ("pix2struct", "Pix2StructVisionMlp", "wo"),
        ("pix2struct", "Pix2StructTextDenseGatedActDense", "wo"),
        ("kosmos2_5", "Kosmos2_5VisionMlp", "wo"),
        ("umt5", "UMT5DenseActDense", "wo"),
        ("nllb_moe", "NllbMoeDenseActDense", "fc2"),
        ("seamless_m4t", "SeamlessM4TFeedForwardNetwork", "fc2"),
    ],
)
def test_families_that_cast_to_a_weight_dtype_are_seen(module, cls, child) -> None:
    """The classes of transformers 5.24 that cast their input to ``<child>.weight.dtype``
    inside an ``if`` (read from the class, no model built)."""
    import importlib

    from hf_fp8.modules.weight_reads import class_weight_reads

    parent = getattr(
        importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls
    )
    assert () in class_weight_reads(parent)[child]  # read under no setting-closable guard


def test_a_checkpoint_with_a_converted_wo_names_the_rule(t5_like_dirs, tmp_path) -> None:
    """A LongT5 checkpoint saved by an hf_fp8 that converted ``wo`` (fp8 codes + scale, not
    listed in ``modules_to_not_convert``) is refused naming the rule and the fix, not
    loaded as a model whose every forward raises."""
    import json

    from safetensors.torch import load_file, save_file

    from hf_fp8.numerics import quantize_weight
    from hf_fp8.numerics.checks import CheckpointTensorError

    model_cls = T5_LIKE["longt5"][1]
    model_cls.from_pretrained(
        t5_like_dirs["longt5"], quantization_config=Fp8Config("weight_only")
    ).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    for key in [k for k in tensors if k.endswith(".wo.weight")]:
        codes, scale = quantize_weight(tensors[key], torch.float8_e4m3fn)
        tensors[key] = codes
        tensors[key.removesuffix("weight") + "weight_scale"] = scale
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    kept = config["quantization_config"]["modules_to_not_convert"]
    config["quantization_config"]["modules_to_not_convert"] = [
        n for n in kept if not n.endswith(".wo")
    ]
    (tmp_path / "config.json").write_text(json.dumps(config))
    pattern = r"\.wo\.weight: .*keeps .*reads its \.weight directly.*re-export"
    with pytest.raises(CheckpointTensorError, match=pattern):
        model_cls.from_pretrained(tmp_path)


class _FlagSetInForward(nn.Module):
    """A flag the forward itself sets (False on a fresh instance): a run-time mode, not a
    setting, so the read under it keeps ``proj``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.needs_cast = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.needs_cast = x.dtype != torch.float32
        if self.needs_cast:
            x = x.to(self.proj.weight.dtype)
        return self.proj(x)


class _FlagSetInAHelper(_FlagGated):
    """Bloom-like guards, but a method (not ``__init__``) switches one of them: run time."""

    def enable_exact(self) -> None:
        setattr(self, "slow_but_exact", True)  # noqa: B010 (the form under test)


class _FlagAugmentedInAHelper(_FlagGated):
    def grow(self) -> None:
        self.pretraining_tp += 1


@pytest.mark.parametrize(
    "module",
    [_FlagSetInForward(), _FlagSetInAHelper(2, False), _FlagAugmentedInAHelper(1, True)],
    ids=["set-in-forward", "setattr-in-helper", "augmented-in-helper"],
)
def test_an_attribute_a_method_assigns_never_closes_a_branch(module) -> None:
    model = nn.Sequential(module)
    assert convertible_modules(model) == []
    # the reviewer's repro: the read branch opens at run time, the layer must stay usable
    if isinstance(module, _FlagSetInForward):
        quantize_model(model, Fp8Config("dynamic"))
        assert type(model[0].proj) is nn.Linear
        out = model(torch.randn(2, 8, dtype=torch.bfloat16))  # forward raised
        assert out.dtype == torch.float32  # cast to the (high-precision) weight's dtype


def test_a_converted_layer_kept_by_a_setting_names_the_setting(tmp_path) -> None:
    """A Bloom FP8 checkpoint saved with the default settings (``dense`` converted) and
    loaded with ``slow_but_exact=True, pretraining_tp=2`` is refused naming the settings
    that open the read, not telling to re-export with this version (which converts
    ``dense`` again)."""
    from hf_fp8.numerics.checks import CheckpointTensorError

    torch.manual_seed(0)
    config = tf.BloomConfig(vocab_size=128, hidden_size=32, n_layer=1, n_head=4)
    tf.BloomForCausalLM(config).save_pretrained(tmp_path / "hp")
    tf.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hp", quantization_config=Fp8Config()
    ).save_pretrained(tmp_path / "fp8")
    with pytest.raises(CheckpointTensorError) as info:
        tf.AutoModelForCausalLM.from_pretrained(
            tmp_path / "fp8", slow_but_exact=True, pretraining_tp=2
        )
    message = str(info.value)
    assert "re-export" not in message
    pattern = (
        r"self_attention\.dense\.weight: .*BloomAttention reads dense\.weight when "
        r"pretraining_tp > 1 and slow_but_exact is true \(here pretraining_tp=2, "
        r"slow_but_exact=True\).*slow_but_exact=False"
    )
    assert re.search(pattern, message), message
    # the setting it names loads the checkpoint
    tf.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", slow_but_exact=False)
