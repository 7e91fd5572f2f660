"""Task heads (linears outside ``model.base_model``) stay in high precision by default (R10 2).

An on-the-fly ``Fp8Config`` load kept Llama's ``score`` (transformers' "last module" skip) but
converted BERT's / RoBERTa's ``classifier``, so the default SEQ_CLS LoRA setup (peft adds the
head to ``modules_to_save``) was refused on encoders. ``from_pretrained`` and
``quantize_model`` now keep every task head; a checkpoint saved with an FP8 head (old code, or
``default_skips=False``) still loads as it was saved."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

from hf_fp8 import Fp8Config, Fp8Linear, quantize_model
from hf_fp8.modules.selection import convertible_modules, high_precision_parts, task_heads

KW = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_labels=3,
)
CASES = {
    "bert-seq": (lambda: tf.BertConfig(**KW), tf.BertForSequenceClassification, ["classifier"]),
    "bert-tok": (lambda: tf.BertConfig(**KW), tf.BertForTokenClassification, ["classifier"]),
    "roberta-seq": (
        lambda: tf.RobertaConfig(**KW, max_position_embeddings=80),
        tf.RobertaForSequenceClassification,
        ["classifier.dense", "classifier.out_proj"],
    ),
    "llama-seq": (
        lambda: tf.LlamaConfig(**KW, num_key_value_heads=2, pad_token_id=0),
        tf.LlamaForSequenceClassification,
        ["score"],
    ),
}


def _saved(case, tmp_path):
    make_config, cls, heads = CASES[case]
    torch.manual_seed(0)
    cls(make_config()).eval().save_pretrained(tmp_path / "hp")
    return tmp_path / "hp", cls, heads


def _ids():
    return torch.randint(1, 128, (2, 10), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("case", list(CASES))
def test_on_the_fly_load_keeps_task_heads_and_quantizes_the_body(case, tmp_path):
    src, cls, heads = _saved(case, tmp_path)
    model = cls.from_pretrained(src, quantization_config=Fp8Config("dynamic"))
    reference = cls.from_pretrained(src)
    assert task_heads(reference) == heads
    for head in heads:
        kept = model.get_submodule(head)
        assert type(kept) is torch.nn.Linear, head
        torch.testing.assert_close(kept.weight, reference.get_submodule(head).weight)
        assert head in model.config.quantization_config.modules_to_not_convert
    body = model.base_model
    assert sum(isinstance(m, Fp8Linear) for m in body.modules()) >= 12  # 2 layers x (4 + 2)


@pytest.mark.parametrize("case", ["bert-seq", "roberta-seq"])
def test_quantize_model_keeps_the_same_task_heads(case, tmp_path):
    src, cls, heads = _saved(case, tmp_path)
    loaded = cls.from_pretrained(src, quantization_config=Fp8Config("dynamic"))
    model = quantize_model(cls.from_pretrained(src), Fp8Config("dynamic"))
    fp8 = sorted(n for n, m in model.named_modules() if isinstance(m, Fp8Linear))
    assert fp8 == sorted(n for n, m in loaded.named_modules() if isinstance(m, Fp8Linear))
    assert not any(h in fp8 for h in heads)
    parts = {g["what"]: g for g in high_precision_parts(model)}
    assert "task heads" in parts, parts.keys()
    assert "task head" in parts["task heads"]["why"]
    assert parts["task heads"]["examples"][0].startswith(heads[0])


@pytest.mark.parametrize("case", ["bert-seq", "roberta-seq"])
def test_default_seq_cls_lora_trains_the_encoder_head(case, tmp_path):
    peft = pytest.importorskip("peft")
    src, cls, _ = _saved(case, tmp_path)
    model = cls.from_pretrained(src, quantization_config=Fp8Config("dynamic"))
    model = peft.get_peft_model(
        model, peft.LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["query", "value"])
    )
    head = model.base_model.model.classifier.modules_to_save["default"]
    before = [p.detach().clone() for p in head.parameters()]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    labels = torch.tensor([0, 2])
    losses = []
    for _ in range(6):
        loss = model(input_ids=_ids(), labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert any(not torch.equal(p, b) for p, b in zip(head.parameters(), before, strict=True))


@pytest.mark.parametrize("listed", [True, False], ids=["saved-list", "hand-written-null"])
def test_checkpoint_saved_with_an_fp8_head_loads_as_saved(tmp_path, listed):
    """Old code converted BERT's classifier: its config lists what it kept, so the reload
    builds the FP8 head again and reads the stored codes and scales bit for bit. A config
    without the list (``null``, hand-written) gets the default skips, but a task head the files
    store as FP8 loads as FP8."""
    src, cls, _ = _saved("bert-seq", tmp_path)
    old = quantize_model(cls.from_pretrained(src), Fp8Config("dynamic"), default_skips=False)
    assert isinstance(old.classifier, Fp8Linear)
    old.save_pretrained(tmp_path / "fp8")
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["quantization_config"]["modules_to_not_convert"] == []
    if not listed:
        config["quantization_config"]["modules_to_not_convert"] = None
        (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    again = cls.from_pretrained(tmp_path / "fp8")
    assert isinstance(again.classifier, Fp8Linear)
    for name in ("weight", "weight_scale"):
        a, b = getattr(again.classifier, name), getattr(old.classifier, name)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    with torch.no_grad():
        torch.testing.assert_close(
            again(input_ids=_ids()).logits, old(input_ids=_ids()).logits, rtol=0, atol=0
        )


def test_base_model_alone_has_no_task_heads(tmp_path):
    src, _, _ = _saved("bert-seq", tmp_path)
    model = tf.AutoModel.from_pretrained(src, quantization_config=Fp8Config("dynamic"))
    assert task_heads(model) == []
    assert isinstance(model.pooler.dense, Fp8Linear)  # unchanged: the pooler is the body's


def test_a_transformers_sub_model_beside_the_base_model_is_a_body_not_a_head():
    """Kyutai's speech-to-text holds its audio codec (``codec_model``, a ``MimiModel`` with
    ~90 linears) beside the base model: it stays convertible; only ``lm_head`` is a head."""
    config = tf.AutoConfig.for_model("kyutai_speech_to_text")
    with torch.device("meta"):
        model = tf.KyutaiSpeechToTextForConditionalGeneration._from_config(config)
    assert any(n.startswith("codec_model.") for n, _, _ in convertible_modules(model))
    assert task_heads(model) == ["lm_head"]
