"""Calibration: observers and ``calibrate()`` for static activation scales."""

from hf_fp8.calibration.calibrate import calibrate
from hf_fp8.calibration.observers import OBSERVERS, make_observer

__all__ = ["OBSERVERS", "calibrate", "make_observer"]
