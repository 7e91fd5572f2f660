"""Gap 13: FULL_STATE_DICT optimizer checkpoints of ``AdamWFp8`` (fp8 moments) under FSDP2 on
two gloo ranks (gloo has no float8 type). accelerate's ``save_state`` / ``load_state`` with a
FULL_STATE_DICT FSDP2 plugin, and plain torch through
``hf_fp8.fsdp.full_optimizer_state_dict_fp8`` / ``set_full_optimizer_state_dict_fp8``: after a
save and a load, training continues bit for bit like the uninterrupted run (on two ranks, and
from the full checkpoint in one process without FSDP); a checkpoint of other optimizer options
or of another model is refused with the fix; a failed write leaves the previous file whole.

One launch of two ranks (this file run as a script) serves every test of the module."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
GLOO_EXIT_ABORT = "terminate called without an active exception"
OPTIM = {"lr": 1e-2, "weight_decay": 0.01}  # AdamWFp8 defaults otherwise: fp8 (COAT) moments
TORCH_OPTIM = {"lr": 1e-2, "weight_decay": 0.01, "min_quantize_numel": 1024}
BEFORE, AFTER = 2, 2  # steps before the checkpoint and after it

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
        reason="needs torch.distributed with gloo",
    ),
]


def _llama(seed: int = 0):
    from transformers import LlamaForCausalLM

    import hf_fp8
    from hf_fp8.utils.tiny import tiny_llama_config

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(64, 2, 32))
    hf_fp8.quantize_model(model, hf_fp8.Fp8Config("dynamic"), skip=["lm_head"])
    return model


def _ids(step: int) -> torch.Tensor:  # the same batch on both ranks: one process matches
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(100 + step))


def _train_llama(acc, model, opt, steps) -> None:
    for step in steps:
        ids = _ids(step)
        acc.backward(model(input_ids=ids, labels=ids, use_cache=False).loss)
        opt.step()
        opt.zero_grad()


def _mlp(widths=(64, 257, 128, 40)):
    """Linear layers with an odd row count (uneven shards), a bias (fp32 state), a norm."""
    from torch import nn

    torch.manual_seed(0)
    a, b, c, d = widths
    return nn.Sequential(
        nn.Linear(a, b), nn.GELU(), nn.Linear(b, c, bias=False), nn.LayerNorm(c), nn.Linear(c, d)
    )


def _train_mlp(model, opt, steps) -> None:
    for step in steps:
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(200 + step))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _full_params(model) -> dict[str, torch.Tensor]:
    from hf_fp8.fsdp import full_tensor_fp8

    return {k: full_tensor_fp8(p).detach().clone() for k, p in model.named_parameters()}


def _shard_mlp(model):
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(model)
    return model


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:1500] + "\n" + traceback.format_exc()[-1500:]


def _accelerate_phase(rank: int, out: Path, result: dict) -> None:
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    import hf_fp8

    def plugin():
        return FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            reshard_after_forward=True,
            state_dict_type="FULL_STATE_DICT",
        )

    ckpt = out / "acc_ckpt"
    acc = Accelerator(mixed_precision="no", fsdp_plugin=plugin())
    model = _llama()
    opt = hf_fp8.AdamWFp8([p for p in model.parameters() if p.requires_grad], **OPTIM)
    model, opt = acc.prepare(model, opt)
    _train_llama(acc, model, opt, range(BEFORE))
    result["acc_fp8_state"] = sorted(
        str(v.dtype) for st in opt.optimizer.state.values() for v in st.values()
    )
    try:
        acc.save_state(str(ckpt))
    except Exception as e:
        result["acc_save_error"] = _error(e)
        return
    _train_llama(acc, model, opt, range(BEFORE, BEFORE + AFTER))
    uninterrupted = acc.get_state_dict(model)
    try:  # the same objects, rewound by the load
        acc.load_state(str(ckpt))
        _train_llama(acc, model, opt, range(BEFORE, BEFORE + AFTER))
        rewound = acc.get_state_dict(model)
    except Exception as e:
        result["acc_load_error"] = _error(e)
        return
    try:  # a fresh accelerator, model (other weights) and optimizer (no state yet)
        acc2 = Accelerator(mixed_precision="no", fsdp_plugin=plugin())
        model2 = _llama(seed=1)
        opt2 = hf_fp8.AdamWFp8([p for p in model2.parameters() if p.requires_grad], **OPTIM)
        model2, opt2 = acc2.prepare(model2, opt2)
        acc2.load_state(str(ckpt))
        _train_llama(acc2, model2, opt2, range(BEFORE, BEFORE + AFTER))
        fresh = acc2.get_state_dict(model2)
    except Exception as e:
        result["acc_fresh_load_error"] = _error(e)
        return
    if rank == 0:
        torch.save(
            {"uninterrupted": uninterrupted, "rewound": rewound, "fresh": fresh},
            out / "acc_params.pt",
        )
    from accelerate import accelerator as acc_module

    try:  # other optimizer options: refused, naming the option; the optimizer keeps no state
        acc3 = Accelerator(mixed_precision="no", fsdp_plugin=plugin())
        model3 = _llama(seed=1)
        opt3 = hf_fp8.AdamWFp8(
            [p for p in model3.parameters() if p.requires_grad], **OPTIM, group_size=64
        )
        model3, opt3 = acc3.prepare(model3, opt3)
        acc3.load_state(str(ckpt))
        result["acc_other_options"] = "loaded"
    except Exception as e:
        result["acc_other_options"] = f"{type(e).__name__}: {e}"
        result["acc_other_options_state"] = len(opt3.optimizer.state)
    # a missing optimizer.bin (rank 0 reads it): every rank raises, none waits for the others
    try:
        acc_module.load_fsdp_optimizer(acc.state.fsdp_plugin, acc, opt, model, str(out / "none"))
        result["missing_file"] = "loaded"
    except Exception as e:
        result["missing_file"] = f"{type(e).__name__}: {e}"
    # a failed write (disk full) leaves the previous optimizer.bin whole and no other file
    file = ckpt / "optimizer.bin"
    before = file.read_bytes() if rank == 0 else b""
    listing = sorted(os.listdir(ckpt)) if rank == 0 else []
    real_save = torch.save

    def failing_save(obj, f, *args, **kwargs):
        if hasattr(f, "write"):  # an open file (the hidden partial file)
            f.write(b"half")
        else:
            with open(f, "wb") as handle:
                handle.write(b"half")
        raise OSError(28, "No space left on device")

    torch.save = failing_save
    try:
        acc_module.save_fsdp_optimizer(acc.state.fsdp_plugin, acc, opt, model, str(ckpt))
        result["failed_write"] = "no error"
    except Exception as e:
        result["failed_write"] = f"{type(e).__name__}: {e}"
    finally:
        torch.save = real_save
    if rank == 0:
        result["failed_write_kept_file"] = file.read_bytes() == before
        result["failed_write_listing"] = sorted(os.listdir(ckpt)) == listing


def _torch_phase(rank: int, out: Path, result: dict) -> None:
    import hf_fp8
    from hf_fp8.fsdp import full_optimizer_state_dict_fp8, set_full_optimizer_state_dict_fp8

    model = _shard_mlp(_mlp())
    opt = hf_fp8.AdamWFp8(model.parameters(), **TORCH_OPTIM)
    _train_mlp(model, opt, range(BEFORE))
    model_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    full_model = _full_params(model)
    osd = full_optimizer_state_dict_fp8(model, opt)  # default: rank 0 gets it, on CPU
    result["torch_full_keys"] = len(osd.get("state", {}))
    if rank == 0:
        torch.save(osd, out / "torch_full_optim.pt")
        torch.save(full_model, out / "torch_model_at_checkpoint.pt")
    _train_mlp(model, opt, range(BEFORE, BEFORE + AFTER))
    uninterrupted = _full_params(model)
    model2 = _shard_mlp(_mlp())
    model2.load_state_dict(model_state)
    opt2 = hf_fp8.AdamWFp8(model2.parameters(), **TORCH_OPTIM)
    set_full_optimizer_state_dict_fp8(model2, opt2, osd if rank == 0 else {})
    _train_mlp(model2, opt2, range(BEFORE, BEFORE + AFTER))
    resumed = _full_params(model2)
    if rank == 0:
        torch.save({"uninterrupted": uninterrupted, "resumed": resumed}, out / "torch_params.pt")
    # moment_format="log" (int8 / uint8 codes), every rank gathering and loading its own copy
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    log_options = {**TORCH_OPTIM, "moment_format": "log", "stochastic_rounding": True}
    model = _shard_mlp(_mlp())
    opt = hf_fp8.AdamWFp8(model.parameters(), **log_options)
    _train_mlp(model, opt, range(BEFORE))
    log_model_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    log_osd = full_optimizer_state_dict_fp8(model, opt, StateDictOptions(full_state_dict=True))
    result["torch_log_keys"] = len(log_osd["state"])
    _train_mlp(model, opt, range(BEFORE, BEFORE + AFTER))
    log_uninterrupted = _full_params(model)
    model2 = _shard_mlp(_mlp())
    model2.load_state_dict(log_model_state)
    opt2 = hf_fp8.AdamWFp8(model2.parameters(), **log_options)
    set_full_optimizer_state_dict_fp8(
        model2, opt2, log_osd, StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    )
    _train_mlp(model2, opt2, range(BEFORE, BEFORE + AFTER))
    log_resumed = _full_params(model2)  # a collective: on every rank
    if rank == 0:
        torch.save(
            {"uninterrupted": log_uninterrupted, "resumed": log_resumed},
            out / "torch_log_params.pt",
        )
    # ranks holding different state entries (rank 1 lost the norm's): refused on every rank
    # before any gather (a gather would pair different tensors across ranks, or hang)
    model = _shard_mlp(_mlp())
    opt = hf_fp8.AdamWFp8(model.parameters(), **TORCH_OPTIM)
    _train_mlp(model, opt, range(1))
    if rank == 1:
        opt.state.pop(model[3].weight)
    try:
        full_optimizer_state_dict_fp8(model, opt)
        result["torch_uneven_states"] = "gathered"
    except Exception as e:
        result["torch_uneven_states"] = f"{type(e).__name__}: {e}"
    # refusals, every rank alike (rank 0's state dict is what counts): other options ...
    for name, options in (
        ("group_size", {**TORCH_OPTIM, "group_size": 64}),
        ("dynamic_range_expansion", {**TORCH_OPTIM, "dynamic_range_expansion": False}),
    ):
        other = _shard_mlp(_mlp())
        other_opt = hf_fp8.AdamWFp8(other.parameters(), **options)
        try:
            set_full_optimizer_state_dict_fp8(other, other_opt, osd if rank == 0 else {})
            result[f"torch_other_{name}"] = "loaded"
        except Exception as e:
            result[f"torch_other_{name}"] = f"{type(e).__name__}: {e}"
            result[f"torch_other_{name}_state"] = len(other_opt.state)
    # ... a damaged state in rows only rank 1 keeps (a NaN scale in the last row): every rank
    # refuses it, not only the one holding those rows
    if rank == 0:
        damaged = {**osd, "state": {k: dict(v) for k, v in osd["state"].items()}}
        scale = damaged["state"]["0.weight"]["exp_avg_sq_scale"].clone()
        scale[-1] = float("nan")
        damaged["state"]["0.weight"]["exp_avg_sq_scale"] = scale
    other = _shard_mlp(_mlp())
    other_opt = hf_fp8.AdamWFp8(other.parameters(), **TORCH_OPTIM)
    try:
        set_full_optimizer_state_dict_fp8(other, other_opt, damaged if rank == 0 else {})
        result["torch_damaged"] = "loaded"
    except Exception as e:
        result["torch_damaged"] = f"{type(e).__name__}: {e}"
    result["torch_damaged_state"] = len(other_opt.state)
    # ... another model with the same parameter names and other shapes, or other names
    for name, build in (
        ("shapes", lambda: _mlp((64, 255, 128, 40))),
        ("names", lambda: torch.nn.Sequential(_mlp())),
    ):
        other = _shard_mlp(build()) if name == "shapes" else build()
        if name == "names":
            _shard_mlp(other[0])
            from torch.distributed.fsdp import fully_shard

            fully_shard(other)
        other_opt = hf_fp8.AdamWFp8(other.parameters(), **TORCH_OPTIM)
        try:
            set_full_optimizer_state_dict_fp8(other, other_opt, osd if rank == 0 else {})
            result[f"torch_model_{name}"] = "loaded"
        except Exception as e:
            result[f"torch_model_{name}"] = f"{type(e).__name__}: {e}"
            result[f"torch_model_{name}_state"] = len(other_opt.state)


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
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    PartialState(cpu=True, timeout=timedelta(seconds=120))
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    result: dict = {}
    for phase in (_torch_phase, _accelerate_phase):
        try:
            phase(rank, out, result)
        except Exception as e:
            result[f"{phase.__name__}_error"] = _error(e)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # torch 2.13: a gloo thread can hang or abort in interpreter teardown


def _launch(out: Path) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank), str(port), str(out)],
            cwd=ROOT,
            env={**env, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        logs = [p.communicate(timeout=500) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (stdout, stderr) in zip(procs, logs, strict=True):
        assert p.returncode == 0 or GLOO_EXIT_ABORT in stderr, f"{stdout[-2000:]}\n{stderr[-4000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("gap13_optim")
    return _launch(out), out


def _assert_bitwise_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want), set(got) ^ set(want)
    for key, ref in want.items():
        a, b = got[key], ref
        assert a.dtype == b.dtype and a.shape == b.shape, key
        if b.dtype.itemsize == 1:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b), key


def _no_phase_errors(results: list[dict], *keys: str) -> None:
    for result in results:
        for key in ("_torch_phase_error", "_accelerate_phase_error", *keys):
            assert key not in result, result[key]


def test_accelerate_full_state_dict_save_and_load_state_resume_bit_exact(ranks):
    """save_state / load_state (FULL_STATE_DICT, FSDP2, gloo) of AdamWFp8 with fp8 moments:
    continuing after the load (same objects rewound, or a fresh accelerator, model and
    optimizer) gives the uninterrupted run's parameters bit for bit."""
    results, out = ranks
    _no_phase_errors(results, "acc_save_error", "acc_load_error", "acc_fresh_load_error")
    assert "torch.float8_e4m3fn" in results[0]["acc_fp8_state"]  # fp8 moments are gathered
    saved = torch.load(out / "acc_ckpt" / "optimizer.bin", weights_only=True)
    codes = [v for st in saved["state"].values() for v in st.values() if v.dtype.itemsize == 1]
    assert codes and all(v.dtype == torch.float8_e4m3fn for v in codes)
    params = torch.load(out / "acc_params.pt", weights_only=True)
    trained = params["uninterrupted"]["model.embed_tokens.weight"]
    assert not torch.equal(trained, _llama().state_dict()["model.embed_tokens.weight"])
    _assert_bitwise_equal(params["rewound"], params["uninterrupted"])
    _assert_bitwise_equal(params["fresh"], params["uninterrupted"])


class _PlainBackward:
    def backward(self, loss) -> None:
        loss.backward()


def _holds_fp8_moments(opt) -> bool:
    """The loaded optimizer keeps FP8 codes (not fp32 moments) for some parameter."""
    return any(
        torch.is_tensor(t) and t.dtype == torch.float8_e4m3fn
        for state in opt.state.values()
        for t in state.values()
    )


def test_accelerate_full_checkpoint_loads_in_one_process_without_fsdp(ranks):
    """accelerate's FULL_STATE_DICT checkpoint (pytorch_model_fsdp.bin + optimizer.bin) in
    one process, plain model: training continues like one uninterrupted single-process run
    and like the two-rank run, bit for bit."""
    import hf_fp8
    from hf_fp8.fsdp import set_full_optimizer_state_dict_fp8

    results, out = ranks
    _no_phase_errors(results, "acc_save_error", "acc_load_error", "acc_fresh_load_error")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks
    try:
        reference = _llama()
        ref_opt = hf_fp8.AdamWFp8([p for p in reference.parameters() if p.requires_grad], **OPTIM)
        _train_llama(_PlainBackward(), reference, ref_opt, range(BEFORE + AFTER))
        model = _llama(seed=1)
        weights = torch.load(out / "acc_ckpt" / "pytorch_model_fsdp.bin", weights_only=True)
        model.load_state_dict(weights)
        opt = hf_fp8.AdamWFp8([p for p in model.parameters() if p.requires_grad], **OPTIM)
        full = torch.load(out / "acc_ckpt" / "optimizer.bin", weights_only=True)
        set_full_optimizer_state_dict_fp8(model, opt, full)
        assert _holds_fp8_moments(opt)
        _train_llama(_PlainBackward(), model, opt, range(BEFORE, BEFORE + AFTER))
    finally:
        torch.set_num_threads(threads)
    _assert_bitwise_equal(model.state_dict(), reference.state_dict())
    two_ranks = torch.load(out / "acc_params.pt", weights_only=True)["uninterrupted"]
    _assert_bitwise_equal(model.state_dict(), two_ranks)


def test_accelerate_full_checkpoint_of_other_options_is_refused(ranks):
    results, _ = ranks
    _no_phase_errors(results)
    for result in results:
        message = result["acc_other_options"]
        assert message.startswith("ValueError"), message
        assert "group_size=128" in message and "create the optimizer" in message, message
        assert result["acc_other_options_state"] == 0  # nothing installed


def test_missing_optimizer_file_raises_on_every_rank(ranks):
    results, _ = ranks
    _no_phase_errors(results)
    assert results[0]["missing_file"].startswith("FileNotFoundError"), results[0]["missing_file"]
    other = results[1]["missing_file"]  # rank 1 never opens the file: told by rank 0
    assert other.startswith("ValueError") and "FileNotFoundError" in other, other


def test_failed_optimizer_write_leaves_the_previous_file_whole(ranks):
    results, _ = ranks
    _no_phase_errors(results)
    assert "No space left on device" in results[0]["failed_write"], results[0]["failed_write"]
    assert results[0]["failed_write_kept_file"]
    assert results[0]["failed_write_listing"]  # no partial file left beside it


def test_torch_full_optimizer_state_dict_resume_on_two_ranks_bit_exact(ranks):
    results, out = ranks
    _no_phase_errors(results)
    assert results[1]["torch_full_keys"] == 0  # cpu_offload: rank 0 only, as torch
    full = torch.load(out / "torch_full_optim.pt", weights_only=True)
    state = full["state"]["0.weight"]  # [257, 64]: both ranks' rows, whole groups
    assert state["exp_avg_fp8"].dtype == torch.float8_e4m3fn
    assert state["exp_avg_fp8"].shape == (257, 128)
    params = torch.load(out / "torch_params.pt", weights_only=True)
    _assert_bitwise_equal(params["resumed"], params["uninterrupted"])


def test_log_moments_full_state_dict_on_every_rank_resume_bit_exact(ranks):
    """moment_format="log" with cpu_offload=False (every rank gathers the whole dict) and
    broadcast_from_rank0=False (every rank loads its own copy)."""
    results, out = ranks
    _no_phase_errors(results)
    assert results[0]["torch_log_keys"] == results[1]["torch_log_keys"] == 7
    params = torch.load(out / "torch_log_params.pt", weights_only=True)
    _assert_bitwise_equal(params["resumed"], params["uninterrupted"])


def test_full_optimizer_checkpoint_loads_in_one_process_without_fsdp(ranks):
    """The two-rank full checkpoint in one process, plain model: training continues like one
    uninterrupted single-process run (and like the two-rank run), bit for bit."""
    import hf_fp8
    from hf_fp8.fsdp import set_full_optimizer_state_dict_fp8

    results, out = ranks
    _no_phase_errors(results)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks
    try:
        reference = _mlp()
        ref_opt = hf_fp8.AdamWFp8(reference.parameters(), **TORCH_OPTIM)
        _train_mlp(reference, ref_opt, range(BEFORE + AFTER))
        model = _mlp()
        model.load_state_dict(torch.load(out / "torch_model_at_checkpoint.pt", weights_only=True))
        opt = hf_fp8.AdamWFp8(model.parameters(), **TORCH_OPTIM)
        full = torch.load(out / "torch_full_optim.pt", weights_only=True)
        set_full_optimizer_state_dict_fp8(model, opt, full)
        assert _holds_fp8_moments(opt)
        _train_mlp(model, opt, range(BEFORE, BEFORE + AFTER))
    finally:
        torch.set_num_threads(threads)
    resumed = {k: p.detach() for k, p in model.named_parameters()}
    _assert_bitwise_equal(resumed, {k: p.detach() for k, p in reference.named_parameters()})
    two_ranks = torch.load(out / "torch_params.pt", weights_only=True)["uninterrupted"]
    _assert_bitwise_equal(resumed, two_ranks)


def test_damaged_full_checkpoint_is_refused_on_every_rank(ranks):
    """The NaN scale lies in rows only rank 1 keeps: both ranks refuse, naming the parameter
    and the entry, and neither installs anything (no rank trains on a half-loaded state)."""
    results, _ = ranks
    _no_phase_errors(results)
    for result in results:
        message = result["torch_damaged"]
        assert message.startswith("ValueError") and "'0.weight'" in message, message
        assert "exp_avg_sq_scale" in message and "non-finite" in message, message
        assert result["torch_damaged_state"] == 0


def test_ranks_with_different_state_entries_are_refused_before_gathering(ranks):
    results, _ = ranks
    _no_phase_errors(results)
    for result in results:
        message = result["torch_uneven_states"]
        assert message.startswith("RuntimeError") and "different optimizer state" in message


def test_torch_full_checkpoint_of_other_options_or_model_is_refused(ranks):
    results, _ = ranks
    _no_phase_errors(results)
    for result in results:  # every rank raises the same error, nothing installed
        for name, fix in (
            ("group_size", "group_size=128"),
            ("dynamic_range_expansion", "dynamic_range_expansion=True"),
        ):
            message = result[f"torch_other_{name}"]
            assert message.startswith("ValueError") and fix in message, message
            assert "create the optimizer" in message, message
            assert result[f"torch_other_{name}_state"] == 0
        shapes = result["torch_model_shapes"]
        assert shapes.startswith("ValueError") and "0.weight" in shapes, shapes
        assert "(255, 64)" in shapes and "another model" in shapes, shapes
        names = result["torch_model_names"]
        assert names.startswith("ValueError") and "0.0.weight" in names, names
        assert "another model" in names, names
        assert result["torch_model_shapes_state"] == result["torch_model_names_state"] == 0


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
