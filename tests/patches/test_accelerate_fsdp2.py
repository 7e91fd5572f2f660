"""The ``accelerate_fsdp2`` patch without processes: when it steps in, and what happens when
accelerate's internals moved (the 2-rank runs are in
``tests/integration/test_accelerate_fp8_mixed_precision.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hf_fp8 import patches
from hf_fp8.modules import Fp8Linear
from hf_fp8.patches import accelerate_fsdp2 as patch
from tests.patches.helpers import check, run_python


def _accelerator(param_dtype: torch.dtype | None) -> SimpleNamespace:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    plugin = SimpleNamespace(
        mixed_precision_policy=MixedPrecisionPolicy(param_dtype=param_dtype),
        reshard_after_forward=True,
        cpu_offload=None,
        ignored_modules=None,
    )
    return SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), torch_device_mesh=None)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Fp8Linear.from_linear(nn.Linear(32, 32)), nn.LayerNorm(32))


def test_accelerate_import_installs_the_patch() -> None:
    import accelerate.accelerator
    import accelerate.utils.fsdp_utils as utils

    assert patch.applied()
    assert accelerate.accelerator.fsdp2_prepare_model is utils.fsdp2_prepare_model
    assert utils.fsdp2_prepare_auto_wrap_policy._hf_fp8
    assert patches.status()["accelerate_fsdp2"] == "on"


def test_models_without_a_casting_policy_or_fp8_modules_pass_through() -> None:
    calls = []
    wrapped = patch._wrap_prepare(lambda acc, model: calls.append(model) or model)
    plain = nn.Sequential(nn.Linear(4, 4))
    assert wrapped(_accelerator(None), _model()) is calls[-1]  # policy keeps dtypes
    assert wrapped(_accelerator(torch.bfloat16), plain) is plain  # nothing FP8
    assert len(calls) == 2


def test_casting_policy_without_the_sharding_step_raises_naming_the_manual_route() -> None:
    """accelerate's preparation changed (never asks for the wrap policy): refuse rather than
    let FSDP2 cast the fp8 codes."""
    wrapped = patch._wrap_prepare(lambda acc, model: model)
    with pytest.raises(RuntimeError, match=r"fully_shard_fp8\(model\) before accelerator.prepare"):
        wrapped(_accelerator(torch.bfloat16), _model())
    assert getattr(patch._PENDING, "kwargs", None) is None  # nothing left for a later call


def test_missing_wrap_policy_function_keeps_the_refusal_and_warns_once() -> None:
    result = run_python(
        """
        import warnings
        import accelerate.utils.fsdp_utils as utils
        del utils.fsdp2_prepare_auto_wrap_policy
        import accelerate.accelerator
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import hf_fp8.patches
            hf_fp8.patches.install()
        print(hf_fp8.patches.status()["accelerate_fsdp2"].split(":")[0])
        print(accelerate.accelerator.fsdp2_prepare_model._hf_fp8)
        print(sum("fully_shard_fp8(model) before" in str(w.message) for w in caught))
        """
    )
    assert check(result).split() == ["partly", "off", "True", "1"]
