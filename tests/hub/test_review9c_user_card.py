"""A card the user wrote from huggingface_hub's template is kept (R17 F2).

huggingface_hub's model card template keeps guidance comments such as
``<!-- Provide a quick summary of what the model is/does. -->`` in every card written from it.
Only a card that is still the unfilled template (every field "[More Information Needed]",
nothing but ``tags`` / ``library_name`` in its metadata: what transformers' ``push_to_hub``
writes) or an hf_fp8 card is replaced; a card with anything the user wrote (one filled section,
a license) is kept as written, with hf_fp8's metadata added. The references are the user's own
text and metadata, and huggingface_hub's / transformers' own placeholder cards.
"""

from __future__ import annotations

import pytest
from huggingface_hub import ModelCard, ModelCardData
from transformers import AutoModelForCausalLM
from transformers.utils import hub as transformers_hub

import hf_fp8
from hf_fp8.hub import CardInfo, read_card_info, write_model_card
from hf_fp8.hub.card import is_user_card, merge_card

REPO = "hf-fp8-tests/tiny-llama-fp8"
OWN = "Trained for 3 days on my private legal corpus. MY_OWN_SECTION: contact me@example.org."
INFO = CardInfo(
    format="hf_fp8",
    architecture="LlamaForCausalLM",
    scheme={
        "activation_scheme": "dynamic",
        "weight_granularity": "tensor",
        "activation_granularity": "token",
        "fp8_format": "e4m3",
        "block_size": [128, 128],
    },
)


def _template(**fields) -> str:
    """huggingface_hub's own default card, ``fields`` filled in (``license=`` as metadata)."""
    license_ = fields.pop("license", None)
    return str(ModelCard.from_template(ModelCardData(license=license_), **fields))


def _transformers_auto_card(monkeypatch, tags=("custom",)) -> str:
    """The card transformers' ``push_to_hub`` writes for a repo without one (its own code)."""
    from huggingface_hub.errors import EntryNotFoundError

    def no_card(*args, **kwargs):
        raise EntryNotFoundError("no README.md")

    monkeypatch.setattr(transformers_hub.ModelCard, "load", no_card)
    return str(transformers_hub.create_and_tag_model_card(REPO, list(tags)))


@pytest.fixture
def fp8_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=hf_fp8.Fp8Config("dynamic")
    )


def test_the_raw_default_template_is_replaced():
    text = _template()
    assert "[More Information Needed]" in text and not is_user_card(text)
    merged = merge_card(text, INFO)
    assert read_card_info(merged) is not None and "[More Information Needed]" not in merged


def test_transformers_auto_card_is_replaced_keeping_its_tags(monkeypatch):
    text = _transformers_auto_card(monkeypatch)
    assert "automatically generated" in text and not is_user_card(text)
    merged = ModelCard(merge_card(text, INFO))
    assert read_card_info(merged.text) is not None
    assert {"custom", "fp8", "hf_fp8"} <= set(merged.data.tags)


def test_a_template_with_one_filled_section_and_a_license_is_kept():
    text = _template(license="apache-2.0", direct_use=OWN)
    assert is_user_card(text)
    merged = ModelCard(merge_card(text, INFO))
    assert merged.text == ModelCard(text).text  # the user's text, byte for byte
    assert merged.data.license == "apache-2.0"
    assert {"fp8", "hf_fp8"} <= set(merged.data.tags) and merged.data.library_name == "hf-fp8"


@pytest.mark.parametrize(
    "what",
    ["license only", "summary", "one field", "transformers card + own paragraph", "title + text"],
)
def test_any_user_content_keeps_the_card(what, monkeypatch):
    if what == "license only":  # nothing filled in but the metadata: the license is the user's
        text = _template(license="apache-2.0")
    elif what == "summary":
        text = _template(model_summary=OWN)
    elif what == "one field":
        text = _template(developers="ACME legal team")
    elif what == "transformers card + own paragraph":
        text = _transformers_auto_card(monkeypatch).replace(
            "## Model Details", f"{OWN}\n\n## Model Details"
        )
    else:  # R17's reproducer: the template's comment line kept under a hand-written card
        text = (
            "---\nlicense: apache-2.0\n---\n# My fine-tuned model\n\n"
            f"<!-- Provide a quick summary of what the model is/does. -->\n\n{OWN}\n"
        )
    assert is_user_card(text)
    merged = ModelCard(merge_card(text, INFO))
    assert merged.text == ModelCard(text).text
    assert read_card_info(merged.text) is None and "hf_fp8" in merged.data.tags


def test_save_pretrained_keeps_a_template_card_the_user_filled(fp8_model, tmp_path):
    """R17 e2e case (a): the folder's hand-written card survives ``save_pretrained``."""
    out = tmp_path / "out"
    out.mkdir()
    text = _template(license="apache-2.0", model_summary=OWN)
    (out / "README.md").write_text(text, encoding="utf-8")
    fp8_model.save_pretrained(out)
    saved = ModelCard((out / "README.md").read_text(encoding="utf-8"))
    assert saved.text == ModelCard(text).text and saved.data.license == "apache-2.0"
    assert "hf_fp8" in saved.data.tags
    assert (out / "model.safetensors").is_file()


def test_write_model_card_keeps_the_usercard_reproducer(tmp_path):
    text = f"---\nlicense: apache-2.0\n---\n# My model\n\n<!-- Provide a quick summary of what the model is/does. -->\n\n{OWN}\n"
    (tmp_path / "README.md").write_text(text, encoding="utf-8")
    write_model_card(tmp_path, INFO)
    written = (tmp_path / "README.md").read_text(encoding="utf-8")
    assert OWN in written and ModelCard(written).data.license == "apache-2.0"
    assert [p.name for p in tmp_path.iterdir()] == ["README.md"]


def test_push_to_hub_replaces_transformers_card(fake_hub, fp8_model):
    """No card on the Hub: transformers writes its placeholder, hf_fp8 replaces it."""
    fp8_model.push_to_hub(REPO)
    uploaded = fake_hub.commits[-1].files["README.md"].decode()
    assert read_card_info(uploaded) is not None and "automatically generated" not in uploaded


def test_push_to_hub_keeps_a_filled_template_card_on_the_hub(fake_hub, fp8_model):
    from tests.hub.fake_hub import write_snapshot

    text = _template(license="apache-2.0", direct_use=OWN)
    write_snapshot(fake_hub.cache_dir, REPO, {"README.md": text.encode()})
    fp8_model.push_to_hub(REPO)
    card = ModelCard(fake_hub.commits[-1].files["README.md"].decode())
    assert card.text == ModelCard(text).text and card.data.license == "apache-2.0"
    assert "hf_fp8" in card.data.tags


def test_an_hf_fp8_card_is_merged_as_before(fp8_model, tmp_path):
    """An hf_fp8 card is re-rendered, keeping its tags and (same model) its figures."""
    out = tmp_path / "out"
    hf_fp8.set_card_info(fp8_model, fidelity={"cosine": 0.999})
    fp8_model.save_pretrained(out)
    card = ModelCard((out / "README.md").read_text(encoding="utf-8"))
    card.data.tags = [*card.data.tags, "mine"]
    (out / "README.md").write_text(str(card), encoding="utf-8")
    assert not is_user_card(str(card))
    again = AutoModelForCausalLM.from_pretrained(out)
    again.save_pretrained(out)
    saved = ModelCard((out / "README.md").read_text(encoding="utf-8"))
    assert read_card_info(saved.text).fidelity == {"cosine": 0.999}
    assert "mine" in saved.data.tags
