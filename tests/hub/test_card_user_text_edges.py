"""Cards a user edited in unusual ways: nothing they wrote is lost, hf_fp8's part is updated
where it can tell it apart, and a card it cannot read safely is kept as it is with one warning.

Cards are written with ``write_model_card`` (the call every route ends in); the user's edits
are strings written here, and every check compares the file with them and with the figures
passed in here.
"""

from __future__ import annotations

import os
import re
import warnings

import pytest
import yaml
from huggingface_hub import ModelCard, ModelCardData

from hf_fp8.hub import CardInfo, write_model_card
from hf_fp8.hub.card import is_user_card, merge_card
from hf_fp8.hub.card_file import MAX_CARD_BYTES
from hf_fp8.utils.folders import UnsafePathError

SCHEME = {
    "activation_scheme": "dynamic",
    "weight_granularity": "tensor",
    "activation_granularity": "token",
    "fp8_format": "e4m3",
    "block_size": [128, 128],
}
OLD, NEW = 0.25, 0.75  # a figure before and after the user's edit
TOP = "USER_TOP: fine-tuned on our legal corpus.\n\n"
SECTION = "\n## Our evaluation\n\nUSER_SECTION: 71.3 on our benchmark.\n"
BEGIN, END = "<!-- hf_fp8:begin", "<!-- hf_fp8:end"


def info(cosine: float) -> CardInfo:
    return CardInfo(architecture="LlamaForCausalLM", scheme=dict(SCHEME), fidelity={"cos": cosine})


def row(value: float) -> str:
    return f"| cos | {value} |"


def front_matter(text: str) -> dict:
    text = text.lstrip("\ufeff").replace("\r\n", "\n")
    match = re.match(r"---\n(.*?)\n?---\n", text, re.S)
    assert match, text[:200]
    return yaml.safe_load(match.group(1)) or {}


def first_card(folder) -> str:
    write_model_card(folder, info(OLD), model_id="tiny")
    return (folder / "README.md").read_text(encoding="utf-8")


def resave(folder, text: str, *, newline: str | None = "") -> str:
    """Put the user's ``text`` in the card, save again with a new figure, return the file."""
    (folder / "README.md").write_text(text, encoding="utf-8", newline=newline)
    write_model_card(folder, info(NEW), model_id="tiny")
    return (folder / "README.md").read_bytes().decode("utf-8")


def split(card: str) -> tuple[str, str]:
    """``(front matter with its --- lines, body)`` of a card written with ``\\n``."""
    end = card.index("\n---\n", 4) + 5
    return card[:end], card[end:]


def lines_without_markers(card: str) -> str:
    """The card as hf_fp8 wrote it before it marked its part (no marker lines)."""
    return "".join(
        line for line in card.splitlines(keepends=True) if not line.startswith((BEGIN, END))
    )


def resave_warned(tmp_path, edited: str) -> tuple[str, list[str]]:
    """Save over ``edited``: (the card, hf_fp8's warnings)."""
    with pytest.warns(UserWarning) as record:
        text = resave(tmp_path, edited)
    return text, [str(w.message) for w in record if "hf_fp8" in str(w.message)]


def names_the_fix(warnings_: list[str]) -> bool:
    """One warning, naming both markers (the fix: put them back as hf_fp8 wrote them)."""
    return len(warnings_) == 1 and "hf_fp8:begin" in warnings_[0] and "hf_fp8:end" in warnings_[0]


# --- markers the user broke or wrote ------------------------------------------------------


def test_markers_quoted_in_a_code_block_keep_the_card(tmp_path):
    quote = f"\n## Editing this card\n\n```markdown\n{BEGIN} -->\n(generated)\n{END} -->\n```\n"
    edited = first_card(tmp_path) + quote
    text, ours = resave_warned(tmp_path, edited)
    assert text == edited
    assert names_the_fix(ours), ours


def test_a_marker_named_in_a_sentence_keeps_the_card(tmp_path):
    note = "\nhf-fp8 rewrites what lies between `<!-- hf_fp8:begin -->` and its end.\n"
    edited = first_card(tmp_path) + note
    text, ours = resave_warned(tmp_path, edited)
    assert text == edited
    assert names_the_fix(ours), ours


@pytest.mark.parametrize("broken", ["no end", "no begin", "half a begin", "two regions", "swapped"])
def test_broken_markers_keep_the_card(broken, tmp_path):
    card = first_card(tmp_path) + SECTION
    lines = card.splitlines(keepends=True)
    begin = next(i for i, line in enumerate(lines) if line.startswith(BEGIN))
    end = next(i for i, line in enumerate(lines) if line.startswith(END))
    if broken == "no end":
        del lines[end]
    elif broken == "no begin":
        del lines[begin]
    elif broken == "half a begin":
        lines[begin] = lines[begin].replace("-->", "")
    elif broken == "two regions":
        lines += ["\n", *lines[begin : end + 1]]
    else:
        lines[begin], lines[end] = lines[end], lines[begin]
    edited = "".join(lines)
    text, ours = resave_warned(tmp_path, edited)
    assert text == edited
    assert names_the_fix(ours), ours


def test_markers_removed_with_text_added_around_keep_it_and_update(tmp_path):
    head, body = split(lines_without_markers(first_card(tmp_path)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        text = resave(tmp_path, f"{head}{TOP}{body}{SECTION}")
    assert text.count(TOP.strip()) == 1 and text.count(SECTION.strip()) == 1
    assert text.index(TOP.strip()) < text.index("## Quantization") < text.index(SECTION.strip())
    assert row(NEW) in text and row(OLD) not in text and text.count("## How to load") == 1


def test_an_empty_marker_pair_in_a_hand_written_card_gets_the_generated_part(tmp_path):
    mine = f"---\nlicense: mit\n---\n# My model\n\n{TOP}{BEGIN} -->\n{END} -->\n{SECTION}"
    text = resave(tmp_path, mine)
    assert text.startswith("---\n") and front_matter(text)["license"] == "mit"
    assert text.index("# My model") < text.index(TOP.strip()) < text.index("## Quantization")
    assert text.index("## Quantization") < text.index(SECTION.strip()) and row(NEW) in text
    assert resave(tmp_path, text) == text  # and it is updated from then on, not frozen


def test_markers_the_user_put_around_own_text_keep_it(tmp_path):
    """A marker pair hf_fp8 did not write (no digest) around text: that text is the user's."""
    mine = f"---\nlicense: mit\n---\n# My model\n\n{BEGIN} -->\n{TOP}{END} -->\n{SECTION}"
    (tmp_path / "README.md").write_text(mine, encoding="utf-8")
    with pytest.warns(UserWarning, match="hf_fp8:begin"):
        write_model_card(tmp_path, info(NEW), model_id="tiny")
    text = (tmp_path / "README.md").read_text(encoding="utf-8")
    assert text.endswith(f"---\n# My model\n\n{BEGIN} -->\n{TOP}{END} -->\n{SECTION}")
    assert front_matter(text)["license"] == "mit"


def test_a_hand_written_card_without_markers_is_kept_byte_for_byte(tmp_path):
    mine = "---\nlicense: mit\n---\n# My model\n\nNo generated part wanted.\n"
    text = resave(tmp_path, mine)
    assert text.endswith("---\n# My model\n\nNo generated part wanted.\n")
    assert front_matter(text)["license"] == "mit" and "hf_fp8" in front_matter(text)["tags"]


# --- cards of an older hf_fp8 (no markers) -------------------------------------------------


def test_an_unedited_older_card_is_rerendered(tmp_path):
    old = lines_without_markers(first_card(tmp_path))
    assert BEGIN not in old and row(OLD) in old
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        text = resave(tmp_path, old)
    assert row(NEW) in text and row(OLD) not in text and text.count("## How to load") == 1


def test_an_older_card_edited_inside_keeps_every_line_with_one_warning(tmp_path):
    old = lines_without_markers(first_card(tmp_path))
    edited = old.replace("## How to load", "USER_MIDDLE: run it on CPU.\n\n## How to load")
    with pytest.warns(UserWarning, match="older hf_fp8") as record:
        text = resave(tmp_path, edited)
    assert len([w for w in record if "hf_fp8" in str(w.message)]) == 1
    _, body = split(edited)
    assert body in text  # the whole edited body, as written
    assert row(NEW) in text  # and the current facts, in a marked part
    again = resave(tmp_path, text)  # from then on: updated without another warning
    assert again == text


# --- metadata ------------------------------------------------------------------------------


def test_metadata_the_user_wrote_is_kept_byte_for_byte(tmp_path):
    head, body = split(first_card(tmp_path))
    mine = "# our license: see LICENSE\nlicense: apache-2.0\nbase_model: acme/base-7b\n"
    edited = f"---\n{mine}{head[4:]}{body}"
    text = resave(tmp_path, edited)
    assert text.startswith(f"---\n{mine}")
    meta = front_matter(text)
    assert meta["license"] == "apache-2.0" and meta["base_model"] == "acme/base-7b"


def test_metadata_comments_stay_when_hf_fp8_adds_its_keys(tmp_path):
    mine = f"---\n# ours: keep\nlicense: mit\ntags:\n- legal\n---\n# Mine\n{BEGIN} -->\n{END} -->\n"
    text = resave(tmp_path, mine)
    assert text.startswith("---\n# ours: keep\nlicense: mit\ntags:\n- legal\n")
    meta = front_matter(text)
    assert meta["license"] == "mit" and meta["tags"][0] == "legal"
    assert {"fp8", "hf_fp8"} <= set(meta["tags"]) and meta["library_name"] == "hf-fp8"


def test_a_commented_key_hf_fp8_would_change_is_left_alone_with_a_warning(tmp_path):
    mine = f"---\ntags: [legal]  # ours\n---\n# Mine\n{BEGIN} -->\n{END} -->\n"
    with pytest.warns(UserWarning, match="comments"):
        text = resave(tmp_path, mine)
    assert text.startswith("---\ntags: [legal]  # ours\n---\n# Mine\n")
    assert row(NEW) in text


def test_a_tag_the_user_added_is_kept(tmp_path):
    card = first_card(tmp_path).replace("- hf_fp8\n", "- hf_fp8\n- legal\n", 1)
    assert "legal" in front_matter(card)["tags"]
    assert "legal" in front_matter(resave(tmp_path, card))["tags"]


# --- encodings, sizes, links ---------------------------------------------------------------


def test_crlf_line_endings_are_kept(tmp_path):
    head, body = split(first_card(tmp_path))
    edited = f"{head}{TOP}{body}{SECTION}".replace("\n", "\r\n")
    text = resave(tmp_path, edited, newline="")
    assert TOP.replace("\n", "\r\n") in text and SECTION.replace("\n", "\r\n") in text
    assert text.count("\n") == text.count("\r\n")  # no bare LF
    assert row(NEW) in text and row(OLD) not in text and text.count("## How to load") == 1
    assert resave(tmp_path, text) == text


def test_a_byte_order_mark_is_kept_and_the_metadata_read(tmp_path):
    head, body = split(first_card(tmp_path))
    edited = f"\ufeff---\nlicense: mit\n{head[4:]}{TOP}{body}"
    text = resave(tmp_path, edited)
    assert text.startswith("\ufeff---\nlicense: mit\n") and text.count("\n---\n") == 1
    assert TOP in text and row(NEW) in text and row(OLD) not in text


def test_a_large_card_keeps_the_users_text(tmp_path):
    head, body = split(first_card(tmp_path))
    big = "USER_LINE " * 7 + "\n"
    filler = big * ((4 * 2**20) // len(big))
    text = resave(tmp_path, f"{head}{body}{filler}")
    assert text.endswith(filler) and row(NEW) in text


def test_an_oversized_card_is_refused_and_left_alone(tmp_path):
    card = tmp_path / "README.md"
    card.write_bytes(b"x" * (MAX_CARD_BYTES + 1))
    with pytest.raises(UnsafePathError, match="more than a model card"):
        write_model_card(tmp_path, info(NEW))
    assert card.stat().st_size == MAX_CARD_BYTES + 1


def test_a_card_that_would_grow_past_the_limit_is_not_written(tmp_path):
    mine = "x" * (MAX_CARD_BYTES - 100) + "\n"
    (tmp_path / "README.md").write_text(f"{BEGIN} -->\n{END} -->\n{mine}", encoding="utf-8")
    before = (tmp_path / "README.md").read_bytes()
    with pytest.raises(UnsafePathError, match="more than a model card"):
        write_model_card(tmp_path, info(NEW))
    assert (tmp_path / "README.md").read_bytes() == before


def test_a_linked_card_is_still_refused(tmp_path):
    target = tmp_path / "elsewhere.md"
    target.write_text("secret notes\n", encoding="utf-8")
    folder = tmp_path / "model"
    folder.mkdir()
    os.symlink(target, folder / "README.md")
    with pytest.raises(UnsafePathError, match="symlink"):
        write_model_card(folder, info(NEW))
    assert target.read_text(encoding="utf-8") == "secret notes\n"
    assert (folder / "README.md").is_symlink()


# --- huggingface_hub's older template (0.14 - 0.17) ----------------------------------------


def test_an_unfilled_card_of_huggingface_hub_0_14_is_a_placeholder():
    """huggingface_hub 0.14.0 - 0.17.x wrote the template with "Data Card" where today's says
    "Dataset Card" and without the "Funded by" field (``git diff v0.14.0 v0.19.0 --
    src/huggingface_hub/templates/modelcard_template.md``)."""
    today = str(ModelCard.from_template(ModelCardData()))
    old = "".join(
        line.replace("Dataset Card", "Data Card")
        for line in today.splitlines(keepends=True)
        if not line.startswith("- **Funded by")
    )
    assert "Data Card" in old and "Funded by" not in old
    assert not is_user_card(old)
    assert "[More Information Needed]" not in merge_card(old, info(NEW))
    filled = old.replace(
        "- **Developed by:** [More Information Needed]", "- **Developed by:** ACME"
    )
    assert is_user_card(filled)
    assert "ACME" in merge_card(filled, info(NEW))
