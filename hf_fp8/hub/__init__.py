"""Sharing: model cards (``hub/templates/``) and uploads. Export lives in ``hf_fp8.serialization``."""

from hf_fp8.hub.card import read_card_info, render_model_card, write_model_card
from hf_fp8.hub.card_info import CardInfo, info_from_model, info_from_summary
from hf_fp8.hub.hooks import attach_card_hooks, set_card_info
from hf_fp8.hub.push import card_for_folder, push_folder

__all__ = [
    "CardInfo",
    "attach_card_hooks",
    "card_for_folder",
    "info_from_model",
    "info_from_summary",
    "push_folder",
    "read_card_info",
    "render_model_card",
    "set_card_info",
    "write_model_card",
]
