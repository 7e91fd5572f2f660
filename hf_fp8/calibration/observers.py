"""Observers: turn the activations a layer sees into one static per-tensor scale."""

from __future__ import annotations

import torch

from hf_fp8.numerics import AMAX_EPS, amax_to_scale, dequantize, quantize_with_scale

OBSERVERS = ("minmax", "moving_average", "percentile", "mse")


class Observer:
    """Base: ``update(x)`` per batch, then ``scale()`` (fp32 ``[1]``) for ``fp8_dtype``.

    NaN / inf values never enter a scale: they are left out and counted in ``nonfinite``.
    ``batches`` counts the updates that held at least one finite value.
    """

    def __init__(self, fp8_dtype: torch.dtype) -> None:
        self.fp8_dtype = fp8_dtype
        self.batches = 0
        self.nonfinite = 0

    def update(self, x: torch.Tensor) -> None:
        x = x.detach()
        finite = torch.isfinite(x)
        if not bool(finite.all()):
            self.nonfinite += int((~finite).sum())
            x = x[finite]
        if x.numel() == 0:  # e.g. a layer (an expert) that got no token in this batch
            return
        self.batches += 1
        self._update(x.float())

    def _update(self, x: torch.Tensor) -> None:
        raise NotImplementedError

    def amax(self) -> torch.Tensor:
        raise NotImplementedError

    def has_information(self) -> bool:
        """True when the activations seen give a usable scale (an amax above ``AMAX_EPS``)."""
        return self.batches > 0 and float(self.amax()) > AMAX_EPS

    def scale(self) -> torch.Tensor:
        if self.batches == 0:
            raise RuntimeError("this layer saw no input during calibration: check the batches")
        if not self.has_information():
            raise RuntimeError(
                "this layer saw only zeros during calibration: a scale from them would "
                "saturate any nonzero input"
            )
        return amax_to_scale(self.amax().reshape(1), self.fp8_dtype)


class MinMaxObserver(Observer):
    """Largest ``|x|`` over all batches (no clipping)."""

    def __init__(self, fp8_dtype: torch.dtype) -> None:
        super().__init__(fp8_dtype)
        self._amax = torch.zeros(())

    def _update(self, x: torch.Tensor) -> None:
        self._amax = torch.maximum(self._amax, x.abs().amax().cpu())

    def amax(self) -> torch.Tensor:
        return self._amax


class MovingAverageObserver(Observer):
    """Exponential moving average of each batch's ``|x|`` max (``momentum`` on the old value)."""

    def __init__(self, fp8_dtype: torch.dtype, momentum: float = 0.9) -> None:
        super().__init__(fp8_dtype)
        if not 0 <= momentum < 1:  # NaN fails too
            raise ValueError(
                f"momentum must be in [0, 1) (the weight of the old average: 0.9 is the "
                f"default, 0 keeps the last batch only), got {momentum}"
            )
        self.momentum = momentum
        self._amax: torch.Tensor | None = None

    def _update(self, x: torch.Tensor) -> None:
        batch = x.abs().amax().cpu()
        self._amax = (
            batch
            if self._amax is None
            else (self.momentum * self._amax + (1 - self.momentum) * batch)
        )

    def amax(self) -> torch.Tensor:
        return self._amax


def _subsample(x: torch.Tensor, limit: int, generator: torch.Generator) -> torch.Tensor:
    """About ``limit`` values of ``x`` (flattened), all of them when there are no more.

    Whole rows (tokens, the last dimension is the channels) at random positions: every
    channel keeps its share, so an outlier channel is always in the sample; no fixed stride
    that could skip channels (a stride dividing the hidden size sees the same few) or alias
    with a sequence length (the first token of every sequence, or none). A 1-D input (the
    finite values of a batch that held NaN / inf) is sampled value by value. ``generator``
    (CPU) makes the choice reproducible.
    """
    if x.numel() <= limit:
        return x.reshape(-1)
    rows = x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(-1, 1)
    keep = max(1, limit // rows.shape[1])  # at least one whole row
    index = torch.randperm(rows.shape[0], generator=generator)[:keep].sort().values
    return rows[index.to(rows.device)].reshape(-1)


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class PercentileObserver(Observer):
    """Mean over batches of the ``percentile``-th percentile of ``|x|`` (clips rare outliers)."""

    def __init__(self, fp8_dtype: torch.dtype, percentile: float = 99.99) -> None:
        super().__init__(fp8_dtype)
        if not 0 < percentile <= 100:
            raise ValueError(f"percentile must be in (0, 100], got {percentile}")
        self.percentile = percentile
        self._sum = torch.zeros(())
        self._generator = _generator()

    def _update(self, x: torch.Tensor) -> None:
        values = _subsample(x.abs(), 1 << 22, self._generator)  # torch.quantile's size limit
        self._sum = self._sum + torch.quantile(values, self.percentile / 100).cpu()

    def amax(self) -> torch.Tensor:
        return self._sum / self.batches


def _priority_sample(
    values: torch.Tensor, weights: torch.Tensor, size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` of the weighted ``values``, re-weighted so that weighted sums stay unbiased.

    Priority sampling (Duffield, Lund, Thorup 2007): priority ``w / u`` with ``u`` uniform in
    ``(0, 1]``, keep the ``size`` highest, new weight ``max(w, tau)`` with ``tau`` the next
    priority. A value that stands for many (a large weight) is kept before one that stands
    for itself, and the kept weights come out about equal (the lowest-variance split).
    """
    if values.numel() <= size:
        return values, weights
    if size <= 0:
        return values[:0], weights[:0]
    u = 1.0 - torch.rand(values.numel(), generator=generator, dtype=torch.float64)
    dropped = torch.topk(weights / u, values.numel() - size, largest=False)  # the few lowest
    keep = torch.ones(values.numel(), dtype=torch.bool)
    keep[dropped.indices] = False
    return values[keep], weights[keep].clamp(min=float(dropped.values.max()))


class MseObserver(Observer):
    """Clipping ``amax`` that minimises the fake-quantization MSE of all inputs, estimated.

    Candidates: ``candidates`` values of ``amax = f * max|x|``, ``f`` evenly in
    ``[0.3, 1]``. Each batch over ``sample // 8`` values gives two strata of ``|x|``: its
    largest ``sample // 16`` exactly (the clipped values, which dominate the error of a
    low clip: an outlier channel is never missed) and whole tokens at random for the rest
    (weighted by how many values they stand for). At most ``sample`` values are kept over
    all batches: the largest ``sample // 2`` of the exact ones stay exact (never thinned,
    however many batches), the others (the random tokens and the exact values they
    displaced) are thinned by priority sampling, re-weighted so that the error estimate of
    all inputs stays unbiased. Seeded: the same batches give the same scale.
    """

    def __init__(self, fp8_dtype: torch.dtype, candidates: int = 50, sample: int = 1 << 18) -> None:
        super().__init__(fp8_dtype)
        if sample < 2:
            raise ValueError(f"sample must be at least 2 (values kept), got {sample}")
        if isinstance(candidates, bool) or int(candidates) != candidates or candidates < 2:
            raise ValueError(
                f"candidates must be an integer of at least 2 (clipping values tried, evenly "
                f"from 0.3 to 1 times max|x|: 1 would try 0.3 * max|x| only), got {candidates}"
            )
        self.candidates, self.sample = int(candidates), sample
        self._best: torch.Tensor | None = None  # the searched amax, until the next update
        self._top = torch.zeros(0)  # the largest |x| kept, each stands for itself
        self._rest = torch.zeros(0)  # other |x| kept, each stands for ``_rest_weight`` values
        self._rest_weight = torch.zeros(0, dtype=torch.float64)
        self._count = 0  # finite values seen
        self._max = torch.zeros(())
        self._generator = _generator()

    def _update(self, x: torch.Tensor) -> None:
        self._best = None  # the search must see this batch too
        magnitude = x.abs()
        self._max = torch.maximum(self._max, magnitude.amax().cpu())  # every value
        n, budget = magnitude.numel(), max(2, self.sample // 8)
        self._count += n
        if n <= budget:
            self._keep(magnitude.reshape(-1).cpu(), torch.zeros(0), torch.zeros(0))
            return
        top = torch.topk(magnitude.reshape(-1), budget // 2, sorted=False).values
        threshold = top.min()
        # values equal to the threshold that the top did not take (saturated inputs: ReLU6)
        tied = int((magnitude == threshold).sum()) - int((top == threshold).sum())
        rest = _subsample(magnitude, budget - top.numel(), self._generator)
        rest = rest[rest < threshold]  # a uniform sample of the values below the top
        below = n - top.numel() - tied
        weight = below / rest.numel() if rest.numel() else 1.0
        weights = torch.full((rest.numel(),), weight, dtype=torch.float64)
        if tied:  # one value standing for all of them, exactly
            rest = torch.cat([rest, threshold.reshape(1)])
            weights = torch.cat([weights, torch.tensor([float(tied)], dtype=torch.float64)])
        self._keep(top.cpu(), rest.cpu(), weights)

    def _keep(self, top: torch.Tensor, rest: torch.Tensor, weights: torch.Tensor) -> None:
        """Merge one batch's strata into the kept values, at most ``sample`` of them
        (``weights``: how many values each of ``rest`` stands for)."""
        exact, displaced = torch.cat([self._top, top]), torch.zeros(0)
        if exact.numel() > self.sample // 2:  # the smallest of them join the thinned values
            smallest = torch.topk(exact, exact.numel() - self.sample // 2, largest=False)
            keep = torch.ones(exact.numel(), dtype=torch.bool)
            keep[smallest.indices] = False
            exact, displaced = exact[keep], smallest.values
        values = torch.cat([self._rest, rest, displaced])
        weights = torch.cat(
            [
                self._rest_weight,
                weights,
                torch.ones(displaced.numel(), dtype=torch.float64),
            ]
        )
        room = self.sample - exact.numel()
        self._top = exact
        self._rest, self._rest_weight = _priority_sample(values, weights, room, self._generator)

    def _estimate_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept values (at most ``sample``) and how many values each stands for."""
        weights = torch.cat([torch.ones(self._top.numel(), dtype=torch.float64), self._rest_weight])
        return torch.cat([self._top, self._rest]), weights

    def amax(self) -> torch.Tensor:
        """The searched amax; computed once, cached until the next ``update`` (R27 F7:
        ``has_information`` and ``scale`` each ask for it)."""
        if self._best is None:
            self._best = self._search()
        return self._best

    def _search(self) -> torch.Tensor:
        x, weight = self._estimate_set()
        best, best_err = self._max, float("inf")
        for frac in torch.linspace(0.3, 1.0, self.candidates):
            amax = self._max * frac
            scale = amax_to_scale(amax.reshape(1), self.fp8_dtype)
            error = (dequantize(quantize_with_scale(x, scale, self.fp8_dtype), scale) - x).pow(2)
            err = float((error * weight).sum()) / self._count
            if err < best_err:
                best, best_err = amax, err
        return best


def make_observer(name: str, fp8_dtype: torch.dtype, **kwargs) -> Observer:
    classes = {
        "minmax": MinMaxObserver,
        "moving_average": MovingAverageObserver,
        "percentile": PercentileObserver,
        "mse": MseObserver,
    }
    if name not in classes:
        raise ValueError(f"observer={name!r} is not supported; use one of {OBSERVERS}")
    return classes[name](fp8_dtype, **kwargs)
