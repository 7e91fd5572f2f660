"""R41: FULL_STATE_DICT optimizer checkpoints under FSDP2 on two gloo ranks, bad inputs.

Every failure rank 0 meets while reading or checking the dict reaches every rank as one
``ValueError`` (before: a ``RecursionError`` / ``NotImplementedError`` on rank 0 left rank 1
waiting in a broadcast until the process-group timeout, finding 6); a torch AdamW checkpoint
loaded into ``AdamWFp8`` under FSDP2 gets fp8 moments, bit for bit the ones one process
converts (finding 5); an AdamWFp8 checkpoint is refused by a plain ``torch.optim.AdamW``
before anything is installed (finding 4, torch helpers and accelerate's ``load_state``);
accelerate's ``optimizer.bin`` that is truncated, empty, a hostile pickle or a symlink out of
the checkpoint folder is refused on every rank naming the file, never advising
``weights_only=False`` (findings 7, 8); a plain AdamW's accelerate round trip still resumes bit
for bit like the uninterrupted run.

One launch of two ranks (this file run as a script) serves every test of the module; the
process group times out after 40 s, so that a rank left waiting fails instead of hanging."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
GLOO_EXIT_ABORT = "terminate called without an active exception"
TORCH_OPTIM = {"lr": 1e-2, "weight_decay": 0.01, "min_quantize_numel": 1024}
PG_TIMEOUT_S = 40

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
        reason="needs torch.distributed with gloo",
    ),
]


def _mlp():
    """Linear layers with an odd row count (uneven shards: rank 1 holds fewer rows)."""
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 257), nn.GELU(), nn.Linear(257, 40))


def _shard(model):
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(model)
    return model


def _train_mlp(model, opt, steps) -> None:
    for step in steps:
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(200 + step))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:3000]


def _torch_phase(rank: int, out: Path, result: dict) -> None:
    import hf_fp8
    from hf_fp8.fsdp import full_optimizer_state_dict_fp8, set_full_optimizer_state_dict_fp8

    # finding 6: rank 0's dict holds a deeply nested list, or a quantized tensor
    model = _shard(_mlp())
    opt = hf_fp8.AdamWFp8(model.parameters(), **TORCH_OPTIM)
    _train_mlp(model, opt, range(1))
    osd = full_optimizer_state_dict_fp8(model, opt)
    for case in ("deep", "qint8"):
        bad = None
        if rank == 0:
            bad = {"state": dict(osd["state"]), "param_groups": [dict(osd["param_groups"][0])]}
            if case == "deep":
                nested: list = []
                for _ in range(5000):
                    nested = [nested]
                bad["param_groups"][0]["note"] = nested
            else:
                st = dict(bad["state"]["2.bias"])
                st["exp_avg"] = torch.quantize_per_tensor(
                    st["exp_avg"].float(), 0.1, 0, torch.qint8
                )
                bad["state"]["2.bias"] = st
        fresh = hf_fp8.AdamWFp8(model.parameters(), **TORCH_OPTIM)
        try:
            set_full_optimizer_state_dict_fp8(model, fresh, bad)
            result[f"bad_{case}"] = "loaded"
        except BaseException as e:
            result[f"bad_{case}"] = _err(e)
        result[f"bad_{case}_state"] = len(fresh.state)

    # finding 5: a torch.optim.AdamW checkpoint into AdamWFp8 (fp32 moments become fp8)
    model = _shard(_mlp())
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    _train_mlp(model, adamw, range(2))
    adamw_osd = full_optimizer_state_dict_fp8(model, adamw)
    full_model = {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(adamw_osd, out / "adamw_osd.pt")
        torch.save(full_model, out / "adamw_model.pt")
    model2 = _shard(_mlp())
    model2.load_state_dict(model.state_dict())
    fp8_opt = hf_fp8.AdamWFp8(model2.parameters(), **TORCH_OPTIM)
    try:
        set_full_optimizer_state_dict_fp8(model2, fp8_opt, adamw_osd if rank == 0 else None)
        converted = full_optimizer_state_dict_fp8(model2, fp8_opt)
        _train_mlp(model2, fp8_opt, range(2, 4))
        after = {k: v.full_tensor().detach().clone() for k, v in model2.state_dict().items()}
        if rank == 0:
            torch.save({"converted": converted, "after": after}, out / "converted.pt")
        result["convert"] = "ok"
    except Exception as e:
        result["convert"] = _err(e) + traceback.format_exc()[-1500:]

    # finding 4: an AdamWFp8 checkpoint into a plain torch.optim.AdamW
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        set_full_optimizer_state_dict_fp8(model, plain, osd if rank == 0 else None)
        result["fp8_into_adamw"] = "loaded"
    except Exception as e:
        result["fp8_into_adamw"] = _err(e)
    result["fp8_into_adamw_state"] = len(plain.state)


def _llama(seed: int = 0):
    from transformers import LlamaForCausalLM

    import hf_fp8
    from hf_fp8.utils.tiny import tiny_llama_config

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(64, 2, 32))
    hf_fp8.quantize_model(model, hf_fp8.Fp8Config("dynamic"), skip=["lm_head"])
    return model


def _train_llama(acc, model, opt, steps) -> None:
    for step in steps:
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(100 + step))
        acc.backward(model(input_ids=ids, labels=ids, use_cache=False).loss)
        opt.step()
        opt.zero_grad()


def _bytes_equal(a: dict, b: dict) -> bool:
    def raw(t):
        return t.view(torch.uint8) if t.element_size() == 1 else t

    return set(a) == set(b) and all(torch.equal(raw(a[k]), raw(b[k])) for k in a)


def _accelerate_phase(rank: int, out: Path, result: dict) -> None:
    from accelerate import Accelerator
    from accelerate import accelerator as acc_module
    from accelerate.utils import FullyShardedDataParallelPlugin

    import hf_fp8

    def plugin():
        return FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            reshard_after_forward=True,
            state_dict_type="FULL_STATE_DICT",
        )

    def trainable(m):
        return [p for p in m.parameters() if p.requires_grad]

    # a plain AdamW's round trip (now read by hf_fp8 first): as the uninterrupted run
    acc = Accelerator(mixed_precision="no", fsdp_plugin=plugin())
    model = _llama()
    opt = torch.optim.AdamW(trainable(model), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    _train_llama(acc, model, opt, range(2))
    plain_ckpt = out / "plain_ckpt"
    acc.save_state(str(plain_ckpt))
    _train_llama(acc, model, opt, range(2, 4))
    uninterrupted = acc.get_state_dict(model)
    try:
        acc.load_state(str(plain_ckpt))
        _train_llama(acc, model, opt, range(2, 4))
        resumed = acc.get_state_dict(model)  # a collective: every rank
        result["plain_resume_bitwise"] = _bytes_equal(resumed, uninterrupted) if rank == 0 else True
    except Exception as e:
        result["plain_resume_bitwise"] = _err(e)

    # an AdamWFp8 checkpoint
    acc = Accelerator(mixed_precision="no", fsdp_plugin=plugin())
    model = _llama()
    opt = hf_fp8.AdamWFp8(trainable(model), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    _train_llama(acc, model, opt, range(2))
    ckpt = out / "fp8_ckpt"
    acc.save_state(str(ckpt))
    file = ckpt / "optimizer.bin"
    good = file.read_bytes() if rank == 0 else b""

    # finding 4 through accelerate: the AdamWFp8 file into a plain AdamW
    acc2 = Accelerator(mixed_precision="no", fsdp_plugin=plugin())
    model2 = _llama()
    plain = torch.optim.AdamW(trainable(model2), lr=1e-2)
    model2, plain = acc2.prepare(model2, plain)
    try:
        acc2.load_state(str(ckpt))
        result["acc_fp8_into_adamw"] = "loaded"
    except Exception as e:
        result["acc_fp8_into_adamw"] = _err(e)
    result["acc_fp8_into_adamw_state"] = len(plain.optimizer.state)

    # findings 7, 8: damaged / hostile / linked optimizer.bin, every rank told
    def try_load(tag: str) -> None:
        acc.wait_for_everyone()
        try:
            acc_module.load_fsdp_optimizer(acc.state.fsdp_plugin, acc, opt, model, str(ckpt))
            result[tag] = "loaded"
        except BaseException as e:
            result[tag] = _err(e)
        acc.wait_for_everyone()

    if rank == 0:
        file.write_bytes(good[: len(good) // 2])
    try_load("truncated")
    if rank == 0:
        file.write_bytes(b"")
    try_load("empty")
    if rank == 0:

        class Evil:
            def __reduce__(self):
                return (os.system, (f"touch {out}/PWNED",))

        with open(file, "wb") as handle:
            pickle.dump({"state": {}, "param_groups": [Evil()]}, handle)
    try_load("hostile")
    result["pwned"] = (out / "PWNED").exists()
    if rank == 0:  # a whole, valid optimizer.bin outside the folder, linked in
        outside = out / "outside_optimizer.bin"
        outside.write_bytes(good)
        file.unlink()
        file.symlink_to(outside)
    try_load("symlink_outside")
    if rank == 0:
        file.unlink()
        file.write_bytes(good)
    try_load("restored")


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

    PartialState(cpu=True, timeout=timedelta(seconds=PG_TIMEOUT_S))
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    result: dict = {}
    for phase in (_torch_phase, _accelerate_phase):
        try:
            phase(rank, out, result)
        except BaseException as e:
            result[f"{phase.__name__}_error"] = _err(e) + traceback.format_exc()[-2000:]
        (out / f"rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # torch 2.13: a gloo thread can hang or abort in interpreter teardown


def _launch(out: Path) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
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
    try:
        logs = [p.communicate(timeout=600) for p in procs]
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
    out = tmp_path_factory.mktemp("review41_optim")
    return _launch(out), out


def _no_phase_errors(results: list[dict]) -> None:
    for result in results:
        for key in ("_torch_phase_error", "_accelerate_phase_error"):
            assert key not in result, result[key]


def test_any_failure_of_rank_0_reaches_every_rank_as_one_value_error(ranks):
    """Finding 6: a deeply nested list (RecursionError before) and a qint8 tensor
    (NotImplementedError before) on rank 0: every rank raises a ValueError naming the cause
    (rank 1 waited for the process-group timeout before), nothing is installed."""
    results, _ = ranks
    _no_phase_errors(results)
    for result in results:
        deep, qint8 = result["bad_deep"], result["bad_qint8"]
        assert deep.startswith("ValueError") and "nested deeper than" in deep, deep
        assert qint8.startswith("ValueError") and "torch.qint8" in qint8, qint8
        assert result["bad_deep_state"] == result["bad_qint8_state"] == 0


def _one_process_conversion(out: Path):
    """The reference: the AdamW checkpoint loaded into AdamWFp8 in one process, no FSDP."""
    import hf_fp8
    from hf_fp8.fsdp import full_optimizer_state_dict_fp8, set_full_optimizer_state_dict_fp8

    model = _mlp()
    model.load_state_dict(torch.load(out / "adamw_model.pt", weights_only=True))
    opt = hf_fp8.AdamWFp8(model.parameters(), **TORCH_OPTIM)
    set_full_optimizer_state_dict_fp8(
        model, opt, torch.load(out / "adamw_osd.pt", weights_only=True)
    )
    converted = full_optimizer_state_dict_fp8(model, opt)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks
    try:
        _train_mlp(model, opt, range(2, 4))
    finally:
        torch.set_num_threads(threads)
    return converted, {k: v.detach() for k, v in model.state_dict().items()}


def test_torch_adamw_checkpoint_gets_fp8_moments_under_fsdp2_as_in_one_process(ranks):
    """Finding 5: the fp32 moments of a torch.optim.AdamW checkpoint become fp8 codes under
    FSDP2 (they stayed fp32 for good before), bit for bit the codes one process converts to,
    and training on continues like the one-process run."""
    results, out = ranks
    _no_phase_errors(results)
    assert results[0]["convert"] == results[1]["convert"] == "ok", results[0]["convert"]
    got = torch.load(out / "converted.pt", weights_only=True)
    want_state, want_params = _one_process_conversion(out)
    assert set(got["converted"]["state"]) == set(want_state["state"])
    assert got["converted"]["state"]["0.weight"]["exp_avg_fp8"].dtype == torch.float8_e4m3fn
    for name, want in want_state["state"].items():
        have = got["converted"]["state"][name]
        assert set(have) == set(want), (name, sorted(have), sorted(want))
        for key, ref in want.items():
            a = have[key]
            assert a.dtype == ref.dtype and a.shape == ref.shape, (name, key)
            if ref.element_size() == 1:
                a, ref = a.view(torch.uint8), ref.view(torch.uint8)
            assert torch.equal(a, ref), (name, key)
    for name, ref in want_params.items():
        assert torch.equal(got["after"][name], ref), name


def test_adamw_fp8_checkpoint_into_plain_adamw_is_refused_before_installing(ranks):
    """Finding 4: torch helpers and accelerate's load_state (RuntimeError 'Invalid scalar
    type' there before; accepted as unscaled moments by the helper)."""
    results, _ = ranks
    _no_phase_errors(results)
    for result in results:
        for tag in ("fp8_into_adamw", "acc_fp8_into_adamw"):
            message = result[tag]
            assert message.startswith("ValueError") and "AdamWFp8" in message, message
            assert "torch_state_dict()" in message, message
            assert result[f"{tag}_state"] == 0
        assert "optimizer.bin" in result["acc_fp8_into_adamw"]


def test_damaged_or_hostile_optimizer_file_is_refused_on_every_rank_naming_it(ranks):
    """Finding 7: truncated / empty file, hostile pickle: a ValueError on every rank that
    names <checkpoint>/optimizer.bin and the fix, and never suggests weights_only=False."""
    results, out = ranks
    _no_phase_errors(results)
    file = str(out / "fp8_ckpt" / "optimizer.bin")
    for result in results:
        for tag, what in (
            ("truncated", "truncated"),
            ("empty", "empty"),
            ("hostile", "not an optimizer state dict"),
        ):
            message = result[tag]
            assert message.startswith("ValueError") and file in message, (tag, message)
            assert what in message, (tag, message)
            assert "weights_only=False" not in message, (tag, message)
            assert "safe_globals" not in message, (tag, message)  # nor allowlisting os.system
            assert "re-save" in message or "trusted checkpoint" in message, (tag, message)
        assert result["pwned"] is False
        assert result["restored"] == "loaded", result["restored"]


def test_optimizer_file_linked_from_outside_the_folder_is_refused(ranks):
    """Finding 8 (DESIGN §8): the link's target is a whole, valid optimizer.bin (the old code
    loaded it); refused on every rank, naming the link."""
    results, _ = ranks
    _no_phase_errors(results)
    for result in results:
        message = result["symlink_outside"]
        assert message.startswith("ValueError") and "symlink" in message, message


def test_plain_adamw_accelerate_round_trip_still_resumes_bit_exact(ranks):
    results, _ = ranks
    _no_phase_errors(results)
    for result in results:
        assert result["plain_resume_bitwise"] is True, result["plain_resume_bitwise"]


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
