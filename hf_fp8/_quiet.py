"""Mute the known start-up noise of optional third-party packages while they import.

transformers' quantizer registry (``transformers.quantizers.auto``) imports torchao when it is
installed. On a CPU machine torchao logs that its CUDA extensions failed to load, and torch
logs a deprecation warning for each Enum torchao registers with ``_pytree``. None of it concerns
hf_fp8 users, so while that one module executes, the two loggers only pass errors.
``hf_fp8.patches.install`` wraps the import in :func:`quiet_import`; an import that already
happened is not affected.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

NOISY_LOGGERS = ("torchao", "torch.utils._pytree")


@contextmanager
def quiet_import(loggers: tuple[str, ...] = NOISY_LOGGERS) -> Iterator[None]:
    """Raise ``loggers`` to ``ERROR`` for the duration of the block, then restore them."""
    saved = {}
    for name in loggers:
        logger = logging.getLogger(name)
        saved[name] = logger.level
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)
