"""Text a user adds to a card hf_fp8 rendered is kept by the next render, on every route that
renders one: ``save_pretrained``, ``export``, the CLI's ``quantize`` / ``calibrate --overwrite``,
``push_folder`` and ``push_to_hub`` (both offline, against ``tests.hub.fake_hub``).

The user's edits are plain strings and YAML written here; every check compares the saved
file with them (and with figures set here), never with hf_fp8's own rendering.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8.cli import main
from tests.hub.fake_hub import write_snapshot
from tests.test_cli import llama_dir  # noqa: F401  (the tiny llama with a tokenizer)

REPO = "hf-fp8-tests/tiny-llama-fp8"
LICENSE_LINE = "license: apache-2.0\n"
TOP = "Fine-tuned on our legal corpus; USER_TOP_PARAGRAPH keeps its place.\n\n"
SECTION = "\n## Our evaluation\n\nUSER_SECTION: 71.3 on our internal benchmark.\n"
DESCRIPTION = ("FP8 model quantized with", "FP8 model (USER_DESCRIPTION_EDIT) quantized with")


def front_matter(text: str) -> dict:
    """The card's YAML metadata, read here with PyYAML (BOM and CRLF tolerated)."""
    text = text.lstrip("\ufeff").replace("\r\n", "\n")
    match = re.match(r"---\n(.*?)\n?---\n", text, re.S)
    assert match, text[:200]
    return yaml.safe_load(match.group(1)) or {}


def user_edits(card: str) -> str:
    """What a person does to a generated card: a license in the metadata, a paragraph at the
    top, a section at the end."""
    assert card.startswith("---\n")
    head, body = card[4:].split("\n---\n", 1)
    return f"---\n{LICENSE_LINE}{head}\n---\n\n{TOP}{body}{SECTION}"


def assert_kept(text: str) -> None:
    """Every piece the user wrote is in ``text`` once, as written."""
    assert front_matter(text).get("license") == "apache-2.0"
    for piece in (TOP.strip(), SECTION.strip()):
        assert text.count(piece) == 1, (piece, text)
    assert text.index(TOP.strip()) < text.index("## Quantization") < text.index(SECTION.strip())


def figure_row(name: str, value: float) -> str:
    return f"| {name} | {value} |"


@pytest.fixture
def fp8_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=hf_fp8.Fp8Config("dynamic")
    )


def test_save_pretrained_keeps_the_users_text_and_updates_its_own(fp8_model, tmp_path):
    out = tmp_path / "fp8"
    hf_fp8.set_card_info(fp8_model, fidelity={"cosine": 0.25})
    fp8_model.save_pretrained(out)
    card = out / "README.md"
    card.write_text(user_edits(card.read_text(encoding="utf-8")), encoding="utf-8")
    hf_fp8.set_card_info(fp8_model, fidelity={"cosine": 0.75})  # measured again
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: the edits are outside
        fp8_model.save_pretrained(out)
    text = card.read_text(encoding="utf-8")
    assert_kept(text)
    assert figure_row("cosine", 0.75) in text and figure_row("cosine", 0.25) not in text
    assert {"fp8", "hf_fp8"} <= set(front_matter(text)["tags"])
    fp8_model.save_pretrained(out)  # a third save changes nothing
    assert card.read_text(encoding="utf-8") == text


def test_a_reloaded_model_saved_into_its_folder_keeps_the_users_text(fp8_model, tmp_path):
    out = tmp_path / "fp8"
    fp8_model.save_pretrained(out)
    card = out / "README.md"
    card.write_text(user_edits(card.read_text(encoding="utf-8")), encoding="utf-8")
    AutoModelForCausalLM.from_pretrained(out).save_pretrained(out)
    assert_kept(card.read_text(encoding="utf-8"))


def test_an_edit_inside_the_generated_part_is_kept_with_one_warning(fp8_model, tmp_path):
    out = tmp_path / "fp8"
    fp8_model.save_pretrained(out)
    card = out / "README.md"
    old, new = DESCRIPTION
    edited = card.read_text(encoding="utf-8").replace(old, new)
    assert new in edited
    card.write_text(edited, encoding="utf-8")
    with pytest.warns(UserWarning, match="hf_fp8:begin") as record:
        fp8_model.save_pretrained(out)
    assert len([w for w in record if "hf_fp8:begin" in str(w.message)]) == 1
    text = card.read_text(encoding="utf-8")
    assert text == edited  # the whole card as the user left it


def test_export_keeps_the_users_text(fp8_model, tmp_path):
    fp8_dir, ct = tmp_path / "fp8", tmp_path / "ct"
    fp8_model.save_pretrained(fp8_dir)
    hf_fp8.export(fp8_dir, ct)
    card = ct / "README.md"
    card.write_text(user_edits(card.read_text(encoding="utf-8")), encoding="utf-8")
    hf_fp8.export(fp8_dir, ct, overwrite=True)
    text = card.read_text(encoding="utf-8")
    assert_kept(text)
    assert "compressed-tensors" in front_matter(text)["tags"]


def test_calibrate_and_save_again_keeps_the_users_text(tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=hf_fp8.Fp8Config("static")
    )
    ids = torch.arange(16).reshape(2, 8)
    hf_fp8.calibrate(model, ids, progress=False)
    out = tmp_path / "static"
    model.save_pretrained(out)
    card = out / "README.md"
    card.write_text(user_edits(card.read_text(encoding="utf-8")), encoding="utf-8")
    hf_fp8.calibrate(model, ids * 3 % 100, progress=False)  # new scales: the card re-renders
    model.save_pretrained(out)
    assert_kept(card.read_text(encoding="utf-8"))


@pytest.mark.parametrize("command", ["quantize", "calibrate"])
def test_cli_overwrite_keeps_the_users_text(command, llama_dir, tmp_path, capsys):  # noqa: F811
    src, out = llama_dir, tmp_path / "out"
    args = ["--out", str(out), "--overwrite"]
    if command == "calibrate":
        data = tmp_path / "data.txt"
        data.write_text("the a of\nto and is in\n", encoding="utf-8")
        args += ["--data", str(data)]
    assert main([command, src, *args]) == 0, capsys.readouterr().err
    card = out / "README.md"
    card.write_text(user_edits(card.read_text(encoding="utf-8")), encoding="utf-8")
    assert main([command, src, *args]) == 0, capsys.readouterr().err
    assert_kept(card.read_text(encoding="utf-8"))


def test_cli_card_names_the_output_folder_not_its_temporary_one(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["quantize", tiny_model_dir("llama"), "--out", str(out)]) == 0
    text = (out / "README.md").read_text(encoding="utf-8")
    assert 'from_pretrained("out")' in text and "hf_fp8-tmp" not in text


def test_push_folder_uploads_the_users_text(fake_hub, fp8_model, tmp_path):
    out = tmp_path / "fp8"
    fp8_model.save_pretrained(out)
    card = out / "README.md"
    edited = user_edits(card.read_text(encoding="utf-8"))
    card.write_text(edited, encoding="utf-8")
    hf_fp8.hub.push_folder(out, REPO)
    uploaded = fake_hub.commits[-1].files["README.md"].decode()
    assert_kept(uploaded)
    assert f'from_pretrained("{REPO}")' in uploaded  # the generated part names the repo
    assert card.read_text(encoding="utf-8") == edited  # the folder is never modified


def test_push_to_hub_keeps_the_users_text_of_the_card_on_the_hub(fake_hub, fp8_model, tmp_path):
    out = tmp_path / "fp8"
    fp8_model.save_pretrained(out)
    edited = user_edits((out / "README.md").read_text(encoding="utf-8"))
    write_snapshot(fake_hub.cache_dir, REPO, {"README.md": edited.encode()})
    fp8_model.push_to_hub(REPO)
    assert_kept(fake_hub.commits[-1].files["README.md"].decode())
