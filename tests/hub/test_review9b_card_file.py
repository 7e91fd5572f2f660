"""A README.md hf_fp8 must not read: never followed, never uploaded, never copied (R14 3).

DESIGN §8: symlinks are not followed. The card of a folder is read by ``push_folder``,
``save_pretrained`` (with and without ``push_to_hub``), ``write_model_card``, the upload hook
and the load hook (the card of the folder a model came from). A README.md that links to a file
outside the folder is refused with ``UnsafePathError`` before anything is written or uploaded
(the load only warns and ignores it); a FIFO, a folder or an oversized file is refused without
blocking or reading it whole. The reference for "leaked" is the secret's own text: it must
appear in no uploaded or written file, and the secret file must be left as it was.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8.hub import info_from_model, push_folder, read_card_info, write_model_card
from hf_fp8.hub.card_file import MAX_CARD_BYTES, read_card
from hf_fp8.hub.hooks import before_upload
from hf_fp8.serialization.atomic import UnsafePathError

SECRET = "PRIVATE: api_key=hunter2\n"
REPO = "hf-fp8-tests/tiny-llama-fp8"


@pytest.fixture
def secret(tmp_path) -> Path:
    path = tmp_path / "outside" / "secret.txt"
    path.parent.mkdir()
    path.write_text(SECRET)
    return path


@pytest.fixture
def fp8_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=hf_fp8.Fp8Config("dynamic")
    )


@pytest.fixture
def checkpoint(fp8_model, tmp_path) -> Path:
    out = tmp_path / "ck"
    fp8_model.save_pretrained(out)
    return out


def _no_secret_in(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            assert b"hunter2" not in path.read_bytes(), path


def _link_card(folder: Path, target: Path) -> None:
    (folder / "README.md").unlink(missing_ok=True)
    os.symlink(target, folder / "README.md")


def test_push_folder_refuses_a_linked_card(checkpoint, secret, fake_hub):
    _link_card(checkpoint, secret)
    with pytest.raises(UnsafePathError, match=r"README\.md is a symlink"):
        push_folder(checkpoint, REPO)
    assert fake_hub.calls == [] and fake_hub.commits == []
    assert secret.read_text() == SECRET


def test_save_pretrained_refuses_a_linked_card_and_writes_nothing(fp8_model, tmp_path, secret):
    out = tmp_path / "save"
    out.mkdir()
    _link_card(out, secret)
    with pytest.raises(UnsafePathError, match=r"README\.md is a symlink"):
        fp8_model.save_pretrained(out)
    assert (out / "README.md").is_symlink() and sorted(os.listdir(out)) == ["README.md"]
    assert secret.read_text() == SECRET


def test_save_pretrained_over_a_checkpoint_with_a_linked_card(fp8_model, checkpoint, secret):
    _link_card(checkpoint, secret)
    with pytest.raises(UnsafePathError, match=r"README\.md is a symlink"):
        fp8_model.save_pretrained(checkpoint)
    assert (checkpoint / "README.md").is_symlink()
    _no_secret_in(checkpoint)
    assert secret.read_text() == SECRET


def test_save_pretrained_push_to_hub_refuses_a_linked_card(fp8_model, tmp_path, secret, fake_hub):
    out = tmp_path / "save"
    out.mkdir()
    _link_card(out, secret)
    with pytest.raises(UnsafePathError, match=r"README\.md is a symlink"):
        fp8_model.save_pretrained(out, push_to_hub=True, repo_id=REPO)
    assert fake_hub.commits == []
    assert secret.read_text() == SECRET


def test_upload_hook_refuses_a_linked_card(fp8_model, tmp_path, secret):
    work = tmp_path / "work"
    work.mkdir()
    _link_card(work, secret)
    with pytest.raises(UnsafePathError, match=r"README\.md is a symlink"):
        before_upload(fp8_model, work, REPO)
    assert secret.read_text() == SECRET


def test_write_model_card_never_writes_through_a_link(fp8_model, tmp_path, secret):
    out = tmp_path / "card"
    out.mkdir()
    _link_card(out, secret)
    info = info_from_model(fp8_model)
    for existing in ({}, {"existing": None}):
        with pytest.raises(UnsafePathError, match=r"README\.md is a symlink"):
            write_model_card(out, info, **existing)
    assert secret.read_text() == SECRET


def test_a_loaded_folder_with_a_linked_card_loads_and_its_target_is_not_read(
    checkpoint, tmp_path, secret
):
    """The card of the folder a model came from is a link to another hf_fp8 card (with
    figures): the load warns, the figures and base model of the link's target stay out."""
    other = tmp_path / "other"
    hf_fp8.set_card_info(
        m := AutoModelForCausalLM.from_pretrained(checkpoint),
        base_model="someone/else",
        fidelity={"secret figure": 0.123},
    )
    m.save_pretrained(other)
    assert read_card_info((other / "README.md").read_text()).fidelity == {"secret figure": 0.123}
    _link_card(checkpoint, other / "README.md")
    with pytest.warns(UserWarning, match=r"README\.md is a symlink"):
        model = AutoModelForCausalLM.from_pretrained(checkpoint)
    out = tmp_path / "resaved"
    model.save_pretrained(out)
    card = read_card_info((out / "README.md").read_text())
    assert card.fidelity == {} and card.base_model != "someone/else"


def _finishes(fn, seconds: float = 20.0):
    """Run ``fn`` in a thread: (done, exception). A call blocked on a FIFO never finishes."""
    result: dict = {}

    def run():
        try:
            fn()
        except BaseException as exc:
            result["exc"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive(), result.get("exc")


def test_a_fifo_card_is_refused_without_blocking(checkpoint, fake_hub):
    (checkpoint / "README.md").unlink()
    os.mkfifo(checkpoint / "README.md")
    done, exc = _finishes(lambda: read_card(checkpoint))
    assert done, "reading a FIFO README.md blocked"
    assert isinstance(exc, UnsafePathError) and "not a regular file" in str(exc)
    done, exc = _finishes(lambda: push_folder(checkpoint, REPO))
    assert done and isinstance(exc, UnsafePathError) and fake_hub.commits == []


def test_a_folder_named_readme_is_refused(checkpoint, fp8_model, fake_hub):
    (checkpoint / "README.md").unlink()
    (checkpoint / "README.md").mkdir()
    (checkpoint / "README.md" / "x.txt").write_text("x")
    with pytest.raises(UnsafePathError, match="not a regular file"):
        push_folder(checkpoint, REPO)
    with pytest.raises(UnsafePathError, match="not a regular file"):
        fp8_model.save_pretrained(checkpoint)
    assert fake_hub.commits == [] and (checkpoint / "README.md" / "x.txt").read_text() == "x"


def test_an_oversized_card_is_refused_unread(checkpoint, fake_hub):
    with open(checkpoint / "README.md", "wb") as f:  # sparse: nothing to read but zeros
        f.truncate(MAX_CARD_BYTES + 1)
    with pytest.raises(UnsafePathError, match="more than a model card may have"):
        push_folder(checkpoint, REPO)
    assert fake_hub.commits == []


def test_a_hard_linked_card_is_the_file_itself(checkpoint, tmp_path, fake_hub):
    """A hard link has no target to follow: it is read like any regular file (as the weights
    are), and the upload carries its text, not a link."""
    text = (checkpoint / "README.md").read_text()
    twin = tmp_path / "twin.md"
    os.link(checkpoint / "README.md", twin)
    push_folder(checkpoint, REPO)
    uploaded = fake_hub.commits[-1].files["README.md"].decode()
    assert read_card_info(uploaded).fp8_layers == read_card_info(text).fp8_layers


def test_a_cached_snapshot_card_is_still_read(fake_hub, checkpoint):
    """A Hub cache snapshot's README.md is a link into its own blobs/: allowed, as for the
    weights (the cache's layout)."""
    from tests.hub.fake_hub import cache_folder

    hf_fp8.set_card_info(
        m := AutoModelForCausalLM.from_pretrained(checkpoint), fidelity={"cosine": 0.99}
    )
    m.save_pretrained(checkpoint)
    commit = cache_folder(fake_hub.cache_dir, REPO, checkpoint)
    snapshot = next(Path(fake_hub.cache_dir).glob(f"models--*/snapshots/{commit}"))
    assert (snapshot / "README.md").is_symlink()
    assert read_card_info(read_card(snapshot)).fidelity == {"cosine": 0.99}
    push_folder(snapshot, REPO)
    assert read_card_info(fake_hub.commits[-1].files["README.md"].decode()).fidelity == {
        "cosine": 0.99
    }
