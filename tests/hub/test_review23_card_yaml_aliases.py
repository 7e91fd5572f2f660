"""R23 F1: a 586-byte README.md whose metadata nests YAML aliases ten deep hung every save
that merges hf_fp8's keys into the user's card: the loaded mapping is cheap (aliases are
shared objects), but comparing it with ``==`` walks the expanded tree (10**10 nodes). Metadata
with aliases is now kept as it is, with one warning, and the save finishes at once."""

from __future__ import annotations

import time
import warnings

import pytest

from hf_fp8.hub import CardInfo, write_model_card


def bomb(depth: int) -> str:
    lines = ["---", "a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, depth):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    return "\n".join([*lines, "---", "USER_TEXT: my own card", ""])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("depth", [2, 10, 30])
def test_metadata_with_aliases_is_kept_and_the_save_finishes(tmp_path, depth) -> None:
    card = tmp_path / "README.md"
    card.write_text(bomb(depth), encoding="utf-8")
    scheme = {
        "activation_scheme": "dynamic",
        "weight_granularity": "tensor",
        "activation_granularity": "token",
        "fp8_format": "e4m3",
        "block_size": [128, 128],
    }
    info = CardInfo(architecture="LlamaForCausalLM", scheme=scheme)
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        write_model_card(tmp_path, info, model_id="tiny")
    assert time.monotonic() - start < 20
    text = card.read_text(encoding="utf-8")
    assert text.startswith(bomb(depth).split("\n---\n")[0] + "\n---\n"), text[:300]
    assert "USER_TEXT: my own card" in text
    assert [w for w in caught if "alias" in str(w.message)], [str(w.message) for w in caught]
