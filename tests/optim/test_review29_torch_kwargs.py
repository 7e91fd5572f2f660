"""R29 finding 7: torch.optim.AdamW's own keywords (``foreach``, ``fused``, ``maximize``,
``capturable``, ``differentiable``) gave a bare ``TypeError`` (unexpected keyword). As for
``amsgrad=False``, AdamWFp8 takes them at the values that change nothing and refuses the
others with a ``ValueError`` naming the value and the alternative. Reference:
torch.optim.AdamW accepts every value here."""

from __future__ import annotations

import pytest
import torch

from hf_fp8.optim import AdamWFp8

NO_OPS = [
    ("foreach", None),
    ("foreach", False),
    ("foreach", True),
    ("fused", None),
    ("fused", False),
    ("maximize", False),
    ("capturable", False),
    ("differentiable", False),
]
REFUSED = [
    ("fused", True, "implementation="),
    ("maximize", True, "negate the loss"),
    ("capturable", True, "torch.optim.AdamW"),
    ("differentiable", True, "torch.optim.AdamW"),
    ("foreach", "yes", "None, False or True"),
    ("maximize", None, "False"),
]


def _step(opt_cls, params, **kwargs):
    opt = opt_cls(params, lr=1e-2, **kwargs)
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    opt.step()


@pytest.mark.parametrize(("key", "value"), NO_OPS)
def test_torch_keywords_at_their_no_op_values_are_accepted(key, value):
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(32, 256))]
    plain = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    _step(AdamWFp8, ours, **{key: value})
    _step(AdamWFp8, plain)
    _step(torch.optim.AdamW, ref[:1], **{key: value})  # torch accepts it too
    for p, q in zip(ours, plain, strict=True):
        assert torch.equal(p.detach(), q.detach())  # no effect on the step
    assert torch.allclose(ours[0].detach(), ref[0].detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize(("key", "value", "hint"), REFUSED)
def test_unsupported_torch_keyword_values_name_the_alternative(key, value, hint):
    with pytest.raises(ValueError, match=key) as info:
        AdamWFp8([torch.nn.Parameter(torch.randn(8))], **{key: value})
    assert hint in str(info.value) and repr(value) in str(info.value)
