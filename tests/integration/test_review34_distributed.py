"""R34 F1/F2: two gloo ranks. The full state dict of an FSDP2-sharded FP8 model (accelerate's
``get_state_dict`` and :func:`hf_fp8.fsdp.full_state_dict_fp8`) equals the unsharded
model's; ``calibrate`` on each rank's own data leaves every rank with the same scales, those
of one process calibrating on the union (minmax) or rank 0's (percentile).

One launch of two ranks (this file run as a script) serves every test of the module."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
GLOO_EXIT_ABORT = "terminate called without an active exception"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
        reason="needs torch.distributed with gloo",
    ),
]


def _model(scheme: str, seed: int = 0):
    from transformers import LlamaForCausalLM

    import hf_fp8
    from hf_fp8.utils.tiny import tiny_llama_config

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(64, 2, 32))
    kw = {"activation_scale": 0.05} if scheme == "static" else {}
    hf_fp8.quantize_model(model, hf_fp8.Fp8Config(scheme, **kw), skip=["lm_head"])
    return model


def _calib_data(rank: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(10 + rank))


def _worker(rank: int, port: int, out: Path) -> None:
    from datetime import timedelta

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
    )
    torch.set_num_threads(1)
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    import hf_fp8

    PartialState(cpu=True, timeout=timedelta(seconds=120))
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        reshard_after_forward=True,
        state_dict_type="FULL_STATE_DICT",
    )
    acc = Accelerator(mixed_precision="bf16", fsdp_plugin=plugin)
    result: dict = {}
    model = _model("dynamic")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, opt = acc.prepare(model, opt)
    try:
        sd = acc.get_state_dict(model)
        result["accelerate_keys"] = len(sd)
        if rank == 0:
            torch.save(sd, out / "accelerate_sd.pt")
    except Exception as e:
        result["accelerate_error"] = f"{type(e).__name__}: {e}"[:400]
    try:  # accelerator.save_state / Trainer checkpoints with FULL_STATE_DICT
        from accelerate.utils import save_fsdp_model

        save_fsdp_model(acc.state.fsdp_plugin, acc, model, str(out / "fsdp_full"))
        result["save_fsdp_model"] = True
    except Exception as e:
        result["save_fsdp_model_error"] = f"{type(e).__name__}: {e}"[:400]
    try:  # accelerator.load_state / Trainer resume with FULL_STATE_DICT, into other weights
        from accelerate.utils import load_fsdp_model

        other = _model("dynamic", seed=1)
        other_opt = torch.optim.AdamW([p for p in other.parameters() if p.requires_grad])
        other, other_opt = acc.prepare(other, other_opt)
        load_fsdp_model(acc.state.fsdp_plugin, acc, other, str(out / "fsdp_full"))
        sd = acc.get_state_dict(other)
        if rank == 0:
            torch.save(sd, out / "loaded_sd.pt")
        result["load_fsdp_model"] = True
    except Exception as e:
        result["load_fsdp_model_error"] = f"{type(e).__name__}: {e}"[:400]
    try:  # FULL_STATE_DICT optimizer checkpoint of AdamWFp8 (fp8 moments) over gloo (HF33)
        from accelerate.utils import save_fsdp_optimizer

        fp8_opt_model = _model("dynamic")
        fp8_opt = hf_fp8.AdamWFp8([p for p in fp8_opt_model.parameters() if p.requires_grad])
        fp8_opt_model, fp8_opt = acc.prepare(fp8_opt_model, fp8_opt)
        ids = _calib_data(0)
        acc.backward(fp8_opt_model(input_ids=ids, labels=ids, use_cache=False).loss)
        fp8_opt.step()
        save_fsdp_optimizer(
            acc.state.fsdp_plugin, acc, fp8_opt, fp8_opt_model, str(out / "fp8_optim")
        )
        result["save_fsdp_optimizer"] = True
    except Exception as e:
        result["save_fsdp_optimizer_error"] = f"{type(e).__name__}: {e}"[:600]
    try:
        from hf_fp8.fsdp import full_state_dict_fp8

        sd = full_state_dict_fp8(model)
        result["helper_keys"] = len(sd)
        if rank == 0:
            torch.save(sd, out / "helper_sd.pt")
    except Exception as e:
        result["helper_error"] = f"{type(e).__name__}: {e}"[:400]
    for observer in ("minmax", "percentile"):
        try:
            scales = hf_fp8.calibrate(
                _model("static"),
                _calib_data(rank),
                observer=observer,
                progress=False,
                distributed=True,
            )
            result[f"scales_{observer}"] = scales
        except Exception as e:
            result[f"calibrate_{observer}_error"] = f"{type(e).__name__}: {e}"[:400]
    # the default is no collective (only one rank may call it): each rank alone, one warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result["scales_default"] = hf_fp8.calibrate(
            _model("static"), _calib_data(rank), observer="minmax", progress=False
        )
    result["default_warnings"] = [str(w.message) for w in caught]
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def _launch(out: Path) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank), str(port), str(out)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    logs = [p.communicate(timeout=400) for p in procs]
    for p, (stdout, stderr) in zip(procs, logs, strict=True):
        assert p.returncode == 0 or GLOO_EXIT_ABORT in stderr, f"{stdout[-2000:]}\n{stderr[-4000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("r34")
    return _launch(out), out


def _assert_equal_state_dicts(full: dict, reference: dict) -> None:
    assert set(full) == set(reference), set(full) ^ set(reference)
    for key, ref in reference.items():
        got = full[key]
        assert got.dtype == ref.dtype and got.shape == ref.shape, key
        if ref.dtype.itemsize == 1:  # fp8 codes: bit-exact
            got, ref = got.view(torch.uint8), ref.view(torch.uint8)
        assert torch.equal(got, ref), key


def test_accelerate_get_state_dict_of_fsdp2_fp8_model_equals_unsharded(ranks):
    results, out = ranks
    for result in results:
        assert "accelerate_error" not in result, result["accelerate_error"]
    assert results[1]["accelerate_keys"] == 0  # rank 0 only, as accelerate's cpu_offload
    full = torch.load(out / "accelerate_sd.pt", weights_only=True)
    _assert_equal_state_dicts(full, _model("dynamic").state_dict())


def test_accelerate_save_fsdp_model_full_state_dict_equals_unsharded(ranks):
    results, out = ranks
    for result in results:
        assert "save_fsdp_model_error" not in result, result["save_fsdp_model_error"]
    full = torch.load(out / "fsdp_full" / "pytorch_model_fsdp.bin", weights_only=True)
    _assert_equal_state_dicts(full, _model("dynamic").state_dict())


def test_accelerate_load_fsdp_model_full_state_dict_restores_the_saved_model(ranks):
    results, out = ranks
    for result in results:
        assert "load_fsdp_model_error" not in result, result["load_fsdp_model_error"]
    loaded = torch.load(out / "loaded_sd.pt", weights_only=True)
    reference = _model("dynamic").state_dict()
    assert not torch.equal(  # the model loaded into had other codes before
        _model("dynamic", seed=1)
        .state_dict()["model.layers.0.mlp.up_proj.weight"]
        .view(torch.uint8),
        reference["model.layers.0.mlp.up_proj.weight"].view(torch.uint8),
    )
    _assert_equal_state_dicts(loaded, reference)


def test_full_state_dict_optimizer_checkpoint_of_fp8_moments_is_written(ranks):
    """HF33 (gap 13): the FULL_STATE_DICT optimizer checkpoint of AdamWFp8's fp8 moments over
    gloo is gathered (fp8 as bytes) and written by rank 0, no longer refused; the bit-exact
    resume is tested in tests/integration/test_gap13_fsdp2_full_optim.py."""
    results, out = ranks
    for result in results:
        assert "save_fsdp_optimizer_error" not in result, result["save_fsdp_optimizer_error"]
    saved = torch.load(out / "fp8_optim" / "optimizer.bin", weights_only=True)
    codes = [v for st in saved["state"].values() for v in st.values() if v.dtype.itemsize == 1]
    assert codes and all(v.dtype == torch.float8_e4m3fn for v in codes)


def test_full_state_dict_fp8_helper_equals_unsharded(ranks):
    results, out = ranks
    for result in results:
        assert "helper_error" not in result, result["helper_error"]
    full = torch.load(out / "helper_sd.pt", weights_only=True)
    _assert_equal_state_dicts(full, _model("dynamic").state_dict())


def test_minmax_calibration_on_two_ranks_equals_one_process_on_union(ranks):
    import hf_fp8

    results, _ = ranks
    for result in results:
        assert "calibrate_minmax_error" not in result, result["calibrate_minmax_error"]
    union = hf_fp8.calibrate(
        _model("static"), [_calib_data(0), _calib_data(1)], observer="minmax", progress=False
    )
    assert results[0]["scales_minmax"] == results[1]["scales_minmax"]
    assert results[0]["scales_minmax"] == pytest.approx(union, rel=0, abs=0)


def test_percentile_calibration_on_two_ranks_takes_rank0_scales(ranks):
    import hf_fp8

    results, _ = ranks
    for result in results:
        assert "calibrate_percentile_error" not in result, result["calibrate_percentile_error"]
    rank0 = hf_fp8.calibrate(
        _model("static"), _calib_data(0), observer="percentile", progress=False
    )
    assert results[0]["scales_percentile"] == results[1]["scales_percentile"]
    assert results[1]["scales_percentile"] == pytest.approx(rank0, rel=0, abs=0)


def test_default_calibration_on_two_ranks_stays_per_rank_and_warns(ranks):
    """R35: a collective by default hung the "main process calibrates" pattern; the default
    calibrates each rank alone (its scales are one process's on its own data) and warns."""
    import hf_fp8

    results, _ = ranks
    for rank, result in enumerate(results):
        alone = hf_fp8.calibrate(
            _model("static"), _calib_data(rank), observer="minmax", progress=False
        )
        assert result["scales_default"] == pytest.approx(alone, rel=0, abs=0)
        assert any("distributed=True" in w for w in result["default_warnings"])
    assert results[0]["scales_default"] != results[1]["scales_default"]


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
