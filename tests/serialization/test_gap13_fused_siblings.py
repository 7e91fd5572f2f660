"""Known gap 1 (thirteenth session): the export's fused-sibling checks knew only Llama's names
(q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj). vLLM stacks other families' sibling
linears into one layer too, and refuses a checkpoint where part of such a group is FP8 and part
kept in high precision; with static activations it serves the whole group with one input
scale, the largest. The groups below are restated from vLLM's model code (learned, not
copied): ``BertModel.packed_modules_mapping`` / its ``stacked_params_mapping`` (query, key,
value -> qkv_proj), ``DeepseekV2Model.load_weights`` (``mla_params_mapping``: q_a_proj and
kv_a_proj_with_mqa -> fused_qkv_a_proj when the model uses MLA; gate/up -> gate_up_proj),
``WhisperForConditionalGeneration.packed_modules_mapping`` (self-attention q/k/v -> qkv_proj;
cross-attention ``encoder_attn`` k/v -> kv_proj, its q_proj alone). Each test judges the export against
vLLM's rule (``should_ignore_layer`` / ``is_layer_skipped``: the shards of one fused layer are
all ignored or none), not against hf_fp8's own table."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import transformers as tf

from hf_fp8 import Fp8Config
from hf_fp8.serialization import export_checkpoint
from tests.tiny_models import VOCAB

FORMATS = ("compressed-tensors", "vllm-fp8")
# vLLM's fused layers of these families, read from its model files
VLLM_PACKED = {
    "bert": {"qkv_proj": ("query", "key", "value")},
    "deepseek_v3": {
        "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    },
}
# where each family's fused layers sit in layer 0 (transformers' module names)
PARENTS = {
    "bert": {"qkv_proj": "encoder.layer.0.attention.self"},
    "deepseek_v3": {
        "fused_qkv_a_proj": "model.layers.0.self_attn",
        "gate_up_proj": "model.layers.0.mlp",
    },
}
_MLA = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=2,  # dense layers only: the attention is under test
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=64,
    n_group=1,
    topk_group=1,
)
FAMILIES = {
    "bert": (
        tf.BertConfig,
        tf.BertModel,
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
        ),
    ),
    "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM, _MLA),
    "whisper": (
        tf.WhisperConfig,
        tf.WhisperForConditionalGeneration,
        dict(
            vocab_size=VOCAB,
            num_mel_bins=16,
            d_model=64,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            max_source_positions=32,
            max_target_positions=32,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=1,
        ),
    ),
}


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    cache: dict[str, str] = {}

    def build(family: str) -> str:
        if family not in cache:
            config_cls, model_cls, kwargs = FAMILIES[family]
            torch.manual_seed(0)
            model = model_cls(config_cls(**kwargs)).eval()
            path = tmp_path_factory.mktemp(family)
            model.save_pretrained(path)
            cache[family] = str(path)
        return cache[family]

    return build


def _load(family_dir, family: str, kept: list[str], scheme: str = "dynamic", **kwargs):
    head = {"bert": [], "whisper": ["proj_out"]}.get(family, ["lm_head"])
    config = Fp8Config(
        scheme, weight_granularity="tensor", modules_to_not_convert=[*head, *kept], **kwargs
    )
    auto = {"bert": tf.AutoModel, "whisper": tf.AutoModelForSpeechSeq2Seq}.get(
        family, tf.AutoModelForCausalLM
    )
    return auto.from_pretrained(family_dir(family), quantization_config=config)


def _ignored(out) -> list[str]:
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    return qc.get("ignore", qc.get("ignored_layers"))


def vllm_loads(ignore: list[str], parent: str, shards: tuple[str, ...]) -> bool:
    """vLLM: the shards of the fused layer under ``parent`` are all ignored or none."""
    return len({f"{parent}.{s}" in ignore for s in shards}) == 1


PARTLY_KEPT = [
    (family, fused, shard)
    for family, groups in VLLM_PACKED.items()
    for fused, shards in groups.items()
    for shard in shards[:2]  # the first two shards of each group, kept alone
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family, fused, kept", PARTLY_KEPT)
def test_partly_kept_group_of_other_families_is_refused(
    family_dir, tmp_path, fmt, family, fused, kept
):
    model = _load(family_dir, family, [kept])
    parent = PARENTS[family][fused]
    shards = VLLM_PACKED[family][fused]
    assert not hasattr(model.get_submodule(f"{parent}.{kept}"), "weight_scale")  # kept
    fp8_sibling = next(s for s in shards if s != kept)
    assert hasattr(model.get_submodule(f"{parent}.{fp8_sibling}"), "weight_scale")  # FP8
    out = tmp_path / "out"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError) as err:
            export_checkpoint(model, out, fmt)
    message = str(err.value)
    assert f"{parent}.{kept}" in message, message
    assert fp8_sibling in message, message
    assert fused in message, message  # what vLLM fuses them into
    assert "modules_to_not_convert" in message, message  # the fix
    assert not out.exists()


WHOLE = [(family, fused) for family, groups in VLLM_PACKED.items() for fused in groups]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family, fused", WHOLE)
def test_whole_groups_of_other_families_export(family_dir, tmp_path, fmt, family, fused):
    shards = VLLM_PACKED[family][fused]
    model = _load(family_dir, family, list(shards))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = export_checkpoint(model, tmp_path / "out", fmt)
    ignore = _ignored(out)
    for layer in range(2):
        for name, group in VLLM_PACKED[family].items():
            parent = PARENTS[family][name].replace(".0.", f".{layer}.")
            assert vllm_loads(ignore, parent, group), (parent, group, ignore)
            kept = name == fused
            assert all((f"{parent}.{s}" in ignore) == kept for s in group), (parent, ignore)


@pytest.mark.parametrize("fmt", FORMATS)
def test_bert_qkv_with_different_static_input_scales_warns(family_dir, tmp_path, fmt):
    """vLLM's BERT serves query/key/value as one qkv_proj with one input scale, the largest."""
    parent = PARENTS["bert"]["qkv_proj"]
    given = {f"{parent}.query": 0.002, f"{parent}.key": 0.02, f"{parent}.value": 0.02}
    model = _load(family_dir, "bert", [], "static", activation_scale=0.01, activation_scales=given)
    scales = {n: float(model.get_submodule(n).input_scale) for n in given}
    assert len(set(scales.values())) == 2  # the model holds what was given
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_checkpoint(model, tmp_path / "out", fmt)
    found = [str(w.message) for w in caught if "input scale" in str(w.message)]
    assert len(found) == 1, found
    largest = max(scales.values())
    assert f"{parent}.query" in found[0] and "qkv_proj" in found[0], found[0]
    assert f"{largest:g}" in found[0] and "largest" in found[0], found[0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_bert_default_export_still_exports(family_dir, tmp_path, fmt):
    """Nothing kept but the default: every fused group is whole (all FP8)."""
    model = _load(family_dir, "bert", [])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = export_checkpoint(model, tmp_path / "out", fmt)
    ignore = _ignored(out)
    for layer in range(2):
        parent = f"encoder.layer.{layer}.attention.self"
        assert not any(f"{parent}.{s}" in ignore for s in VLLM_PACKED["bert"]["qkv_proj"])


# Whisper in vLLM: self-attention q/k/v -> qkv_proj; cross-attention k/v -> kv_proj, q_proj alone
WHISPER_SELF = ("model.decoder.layers.0.self_attn", ("q_proj", "k_proj", "v_proj"))
WHISPER_CROSS = ("model.decoder.layers.0.encoder_attn", ("k_proj", "v_proj"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_whisper_cross_attention_query_kept_alone_exports(family_dir, tmp_path, fmt):
    """vLLM does not fuse the cross-attention's q_proj (it reads the decoder, k/v the
    encoder): keeping it alone in high precision is a checkpoint vLLM loads."""
    model = _load(family_dir, "whisper", ["encoder_attn.q_proj"])
    cross = WHISPER_CROSS[0]
    assert not hasattr(model.get_submodule(f"{cross}.q_proj"), "weight_scale")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = export_checkpoint(model, tmp_path / "out", fmt)
    ignore = _ignored(out)
    assert f"{cross}.q_proj" in ignore
    for parent, group in (WHISPER_SELF, WHISPER_CROSS):
        assert vllm_loads(ignore, parent, group), (parent, ignore)
        assert not any(f"{parent}.{s}" in ignore for s in group)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "kept, group", [("encoder_attn.k_proj", WHISPER_CROSS), ("self_attn.q_proj", WHISPER_SELF)]
)
def test_whisper_partly_kept_groups_are_refused(family_dir, tmp_path, fmt, kept, group):
    model = _load(family_dir, "whisper", [kept])
    parent, shards = group
    out = tmp_path / "out"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError) as err:
            export_checkpoint(model, out, fmt)
    message = str(err.value)
    fused = "kv_proj" if len(shards) == 2 else "qkv_proj"
    assert f"{parent}.{fused}" in message, message  # vLLM's fused layer, by its full name
    assert f"{parent}.{kept.rpartition('.')[2]}" in message, message
    assert "modules_to_not_convert" in message, message
    assert not out.exists()
