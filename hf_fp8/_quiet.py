"""Imported first by ``hf_fp8``: transformers' quantizer registry imports torchao when it is
installed, and torchao logs the load failure of its optional CUDA extensions on CPU machines.
Those messages are muted while ``hf_fp8`` imports, then the logger's level is restored."""

import logging

_torchao_logger = logging.getLogger("torchao")
_saved_level = _torchao_logger.level
_torchao_logger.setLevel(logging.ERROR)


def restore_logging() -> None:
    _torchao_logger.setLevel(_saved_level)
