"""Installed means loadable: the wheel (and the editable install) ship the autoload ``.pth``, the
card template as package data; uninstalling removes the hook."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PTH = "hf-fp8-autoload.pth"
TEMPLATE = "hf_fp8/hub/templates/hf_fp8_model_card.md.j2"
MAIN_SITE = sysconfig.get_paths()["purelib"]  # torch, transformers ... (not its .pth files)

pytestmark = pytest.mark.slow

# Loads an hf_fp8 checkpoint in a fresh interpreter WITHOUT importing hf_fp8; prints a JSON line.
LOAD_WITHOUT_IMPORT = textwrap.dedent(
    """
    import json, sys, torch
    from transformers import AutoModelForCausalLM
    fp8_dir, inputs, out = sys.argv[1:4]
    assert "hf_fp8" not in sys.modules
    model = AutoModelForCausalLM.from_pretrained(fp8_dir)
    with torch.no_grad():
        torch.save(model(**torch.load(inputs)).logits, out)
    layer = model.model.layers[0].mlp.up_proj
    hf_fp8 = sys.modules.get("hf_fp8")
    print(json.dumps({"layer": type(layer).__name__, "hf_fp8": getattr(hf_fp8, "__file__", None)}))
    """
)


def _run(cmd, *, env=None, cwd=None, check=True):
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    full_env.pop("PYTHONPATH", None)
    result = subprocess.run(
        [str(c) for c in cmd], env=full_env, cwd=cwd, capture_output=True, text=True, timeout=600
    )
    if check:
        assert result.returncode == 0, f"{cmd}\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            out,
            ROOT,
        ]
    )
    (path,) = out.glob("hf_fp8-*.whl")
    return path


def _venv(root: Path, wheel: Path) -> Path:
    """A venv that sees the main environment's packages (not its editable hf_fp8) and has
    the wheel installed by pip; returns its python."""
    _run([sys.executable, "-m", "venv", "--without-pip", root])
    python = root / "bin" / "python"
    site = Path(
        _run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
        ).stdout.strip()
    )
    (site / "_main_env.pth").write_text(MAIN_SITE + "\n")
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            python,
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            wheel,
        ]
    )
    return python


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """A tiny llama saved by hf_fp8 (dynamic), its inputs and the in-process FP8 logits."""
    from transformers import AutoModelForCausalLM

    import hf_fp8
    from tests.tiny_models import TINY, model_inputs

    root = tmp_path_factory.mktemp("ckpt")
    config_cls, model_cls, kwargs = TINY["llama"]
    torch.manual_seed(0)
    model_cls(config_cls(**kwargs)).eval().save_pretrained(root / "hp")
    model = AutoModelForCausalLM.from_pretrained(
        root / "hp", quantization_config=hf_fp8.Fp8Config("dynamic")
    )
    model.save_pretrained(root / "fp8")
    inputs = model_inputs("llama")
    torch.save(inputs, root / "inputs.pt")
    with torch.no_grad():
        reference = model(**inputs).logits
    return root, reference


def _load_without_import(python, fp8_checkpoint, cwd, env=None):
    root, reference = fp8_checkpoint
    out = cwd / "logits.pt"
    result = _run(
        [python, "-c", LOAD_WITHOUT_IMPORT, root / "fp8", root / "inputs.pt", out],
        cwd=cwd,
        env={"HF_FP8_COMPILE": os.environ.get("HF_FP8_COMPILE", "1"), **(env or {})},
    )
    info = json.loads(result.stdout.strip().splitlines()[-1])
    logits = torch.load(out)
    rel = ((logits - reference).norm() / reference.norm()).item()
    return info, rel, result.stderr


def test_wheel_ships_the_hook_and_the_template(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        record = zf.read(next(n for n in names if n.endswith(".dist-info/RECORD"))).decode()
    assert {PTH, "_hf_fp8_autoload.py", TEMPLATE} <= names
    assert not [n for n in names if ".data/" in n]  # nothing under <prefix>/share any more
    assert f"{PTH}," in record  # pip uninstall removes what RECORD lists


def test_installed_wheel_loads_fp8_without_import_and_uninstall_removes_it(
    wheel, fp8_checkpoint, tmp_path
):
    python = _venv(tmp_path / "venv", wheel)
    work = tmp_path / "work"
    work.mkdir()
    # start-up: only the tiny hook module, neither torch nor transformers
    probe = "import sys; print([m in sys.modules for m in ('_hf_fp8_autoload', 'torch', 'transformers', 'hf_fp8')])"
    assert _run([python, "-c", probe], cwd=work).stdout.strip() == "[True, False, False, False]"

    info, rel, _ = _load_without_import(python, fp8_checkpoint, work)
    assert info["layer"] == "Fp8Linear"
    assert info["hf_fp8"].startswith(str(tmp_path / "venv"))  # the installed wheel, not the tree
    assert rel < 1e-6

    # the card renders from the installed package data
    card = _run(
        [
            python,
            "-c",
            "from hf_fp8.hub import CardInfo, render_model_card; "
            "print(render_model_card(CardInfo(repo_id='org/tiny-fp8')))",
        ],
        cwd=work,
    ).stdout
    assert "pip install hf-fp8" in card and 'from_pretrained("org/tiny-fp8")' in card

    _run([sys.executable, "-m", "pip", "--python", python, "uninstall", "-y", "-q", "hf-fp8"])
    assert _run([python, "-c", probe], cwd=work).stdout.strip() == "[False, False, False, False]"
    site = Path(
        _run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
        ).stdout.strip()
    )
    assert not (site / PTH).exists()


def test_target_install_renders_a_card(wheel, tmp_path):
    """``pip install --target`` (like ``--user`` / ``--prefix``: no <prefix>/share lookup)."""
    target = tmp_path / "target"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--target",
            target,
            wheel,
        ]
    )
    code = (
        f"import hf_fp8.hub.card as c; assert c.__file__.startswith({str(target)!r}), c.__file__; "
        "scheme = dict(activation_scheme='dynamic', weight_granularity='row', "
        "activation_granularity='token', block_size=[128, 128], fp8_format='e4m3'); "
        "print(c.render_model_card(c.CardInfo(repo_id='org/x', scheme=scheme)))"
    )
    result = _run(
        [
            sys.executable,
            "-S",
            "-c",
            f"import sys; sys.path[:0] = [{str(target)!r}, {MAIN_SITE!r}]; {code}",
        ],
        cwd=tmp_path,
    )
    assert "hf-fp8 export org/x --format compressed-tensors" in result.stdout


def test_editable_install_loads_fp8_without_import(fp8_checkpoint, tmp_path):
    """The development install (``make`` runs ``pip install -e``) has the hook too."""
    if not (Path(MAIN_SITE) / PTH).exists():
        pytest.fail(f"{PTH} is not in {MAIN_SITE}: re-install with `make` (pip install -e .)")
    info, rel, _ = _load_without_import(sys.executable, fp8_checkpoint, tmp_path)
    assert info["layer"] == "Fp8Linear" and rel < 1e-6


def test_autoload_off_gives_transformers_unknown_method_warning(fp8_checkpoint, tmp_path):
    """``HF_FP8_AUTOLOAD=0`` is what a machine without hf-fp8 sees: transformers' warning, and
    a model with wrong outputs (the reason the card's first lines say to install hf-fp8)."""
    info, rel, stderr = _load_without_import(
        sys.executable, fp8_checkpoint, tmp_path, env={"HF_FP8_AUTOLOAD": "0"}
    )
    assert info["layer"] == "Linear" and info["hf_fp8"] is None
    assert "Unknown quantization type, got hf_fp8" in stderr
    assert "we will skip the quantization" in stderr
    assert rel > 0.5  # garbage: the FP8 codes without their scales
