"""benchmarks/gpu_check.py runs every code path on tiny CPU shapes (the GPU run needs a lent
H100/H200; this keeps the script from rotting between such runs)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "gpu_check.py"


@pytest.mark.slow
def test_gpu_check_cpu_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "gpu.json"
    info = module.main(["--cpu-smoke", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rows == info["rows"]
    checks = {r["check"] for r in rows}
    assert checks == {"parity", "linear", "mlp_block", "optimizer"}
    parity = [r for r in rows if r["check"] == "parity"]
    assert len(parity) == 6 and all(r["max_rel_diff"] == 0.0 for r in parity)  # CPU: both emulated
    # against gpu_check's own float64 reference (not hf_fp8's numerics): bf16 output and
    # product roundings, and the odd fp8 rounding decision of a float64 vs fp32 scale
    for r in parity:
        assert r["auto_rel_err_vs_reference"] <= 2**-6, r
        assert r["emulated_rel_err_vs_reference"] <= 2**-6, r
    assert all(r["ms"] > 0 for r in rows if "ms" in r)
    assert not [r for r in rows if "skipped" in r]  # no time budget on the smoke run
    linear = {(r["mode"], r["variant"]) for r in rows if r["check"] == "linear"}
    assert ("compiled", "dynamic/row") in linear and ("eager", "weight_only/row") in linear
    assert {r["variant"] for r in rows if r["check"] == "mlp_block"} == {
        "bf16",
        "dynamic/row",
        "static/tensor",
    }
    states = {r["variant"]: r["state_bytes_per_param"] for r in rows if r["check"] == "optimizer"}
    assert states["AdamW fused"] == 8.0
    # 2-D parameters above min_quantize_numel: FP8 moments, not AdamWFp8's fp32 fallback
    assert states["AdamWFp8 coat"] < 4 and states["AdamWFp8 plain"] < 4
