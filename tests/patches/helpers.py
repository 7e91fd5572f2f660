"""Run a snippet in a fresh interpreter (import-time state of transformers / hf_fp8 matters)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A tiny llama saved in high precision at HP, and hf_fp8 (dynamic) at FP8; REF is the FP8
# model's logits computed in that process.
TINY_SETUP = """
import torch
from tests.tiny_models import TINY, model_inputs
config_cls, model_cls, kwargs = TINY["llama"]
torch.manual_seed(0)
model_cls(config_cls(**kwargs)).eval().save_pretrained(HP)
"""


def run_python(code: str, *, env: dict[str, str] | None = None, timeout: int = 300):
    """``python -c code`` from the repository root; returns the ``CompletedProcess``."""
    full_env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_FP8_COMPILE": "0",
        "PYTHONWARNINGS": "default",
        "PYTHONPATH": str(ROOT),
        **(env or {}),
    }
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def patch_warnings(stderr: str) -> list[str]:
    """The ``PatchWarning`` lines printed by the subprocess."""
    return [line for line in stderr.splitlines() if "PatchWarning" in line]


def check(result) -> str:
    """The subprocess succeeded; returns its stdout."""
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout
