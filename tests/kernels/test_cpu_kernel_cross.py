"""The NEON path, which an x86 machine cannot load: built for aarch64 with a cross compiler
and run under qemu through a C driver (tests/kernels/csrc/fp8_driver.c). Its outputs must
equal the portable C path's (aarch64) and the host's portable path: decode and activation
quantization bit for bit (any NaN equals any NaN), the GEMV within fp32 reassociation."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SOURCE = ROOT / "hf_fp8" / "kernels" / "csrc" / "fp8_gemv.c"
DRIVER = Path(__file__).parent / "csrc" / "fp8_driver.c"
FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-pthread"]
NATIVE_ARM = platform.machine().lower() in ("aarch64", "arm64")
CROSS = None if NATIVE_ARM else shutil.which("aarch64-linux-gnu-gcc")
QEMU = shutil.which("qemu-aarch64")
HOST_CC = shutil.which("cc") or shutil.which("gcc")

pytestmark = pytest.mark.skipif(
    not HOST_CC or not (NATIVE_ARM or (CROSS and QEMU)),
    reason="needs an aarch64 machine, or aarch64-linux-gnu-gcc and qemu-aarch64",
)


def _run(tmp: Path, name: str, path_id: int, arm: bool) -> list[str]:
    exe = tmp / name
    cc = (HOST_CC if NATIVE_ARM else CROSS) if arm else HOST_CC
    extra = ["-static"] if arm and not NATIVE_ARM else []
    subprocess.run(
        [
            cc,
            *FLAGS,
            *extra,
            f"-DFP8_PATH={path_id}",
            str(SOURCE),
            str(DRIVER),
            "-o",
            str(exe),
            "-lm",
        ],
        check=True,
        capture_output=True,
    )
    cmd = [QEMU, str(exe)] if arm and not NATIVE_ARM else [str(exe)]
    return subprocess.run(
        cmd, check=True, capture_output=True, text=True, timeout=300
    ).stdout.split("\n")


def _is_nan(kind: str, value: str) -> bool:
    bits = int(value, 16)
    if kind == "decb":
        return (bits & 0x7FFF) > 0x7F80
    return (bits & 0x7FFFFFFF) > 0x7F800000


def _compare(got: list[str], want: list[str]) -> int:
    """Assert two drivers' outputs agree (decode exactly, GEMV within 2**-14); return how
    many lines were compared."""
    assert len(got) == len(want) > 1000
    gemv: dict[str, list[tuple[float, float]]] = {}
    for g, w in zip(got, want, strict=True):
        if not g:
            continue
        gk, wk = g.rsplit(" ", 1), w.rsplit(" ", 1)
        assert gk[0] == wk[0], (g, w)
        kind = gk[0].split()[0]
        if kind == "gemv":
            gemv.setdefault(gk[0], []).append((float(gk[1]), float(wk[1])))
        elif gk[1] != wk[1]:
            assert _is_nan(kind, gk[1]) and _is_nan(kind, wk[1]), (g, w)
    for key, pairs in gemv.items():
        scale = max(abs(w) for _, w in pairs) or 1.0
        worst = max(abs(g - w) for g, w in pairs) / scale
        assert worst <= 2.0**-14, (key, worst)
    return sum(1 for g in got if g)


def test_neon_path_matches_the_portable_path(tmp_path) -> None:
    neon = _run(tmp_path, "neon", 1, arm=True)
    scalar_arm = _run(tmp_path, "scalar_arm", 0, arm=True)
    scalar_host = _run(tmp_path, "scalar_host", 0, arm=False)
    assert _compare(neon, scalar_arm) > 1000
    assert _compare(scalar_arm, scalar_host) > 1000
