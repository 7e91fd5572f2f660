"""Model cards: render ``hf_fp8/hub/templates/hf_fp8_model_card.md.j2`` (Jinja2, package data),
embed the facts so a later push can re-render them, and respect cards the user wrote."""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2
from huggingface_hub import ModelCard, ModelCardData

from hf_fp8.hub.card_file import read_card, write_card
from hf_fp8.hub.card_info import UNKNOWN_SCALES, CardInfo, hub_model_id
from hf_fp8.serialization.summary import activation_words, weight_words

TEMPLATE_NAME = "hf_fp8_model_card.md.j2"
TAGS = ("fp8", "hf_fp8")
_DATA_START = "<!-- hf_fp8 card data: "
_DATA_END = " -->"
# A placeholder card is huggingface_hub's template with nothing filled in: every field still
# says _UNFILLED, and its metadata holds no more than the keys transformers' push_to_hub sets.
_UNFILLED = "[More Information Needed]"
_AUTO_METADATA = frozenset({"tags", "library_name"})
_AUTO_PATTERNS = (
    # transformers' model_description for a repo without a card (utils/hub.py)
    re.compile(
        r"This is the model card of a 🤗 transformers model that has been pushed on the Hub\."
        r"( This model card has been automatically generated\.)?"
    ),
    re.compile(r"# Model Card for \S.*"),  # the template's title, any model_id
    re.compile(r"(- \*\*[^*\n]+:\*\* )?\[More Information Needed\]( <!--.*-->)?"),
)
_FORMAT_WORDS = {
    "hf_fp8": 'hf_fp8 (`quant_method: "hf_fp8"`): fp8 `weight`, fp32 `weight_scale` / `input_scale`',
    "compressed-tensors": "compressed-tensors `float-quantized` (vLLM, SGLang, TGI, transformers)",
    "vllm-fp8": 'vLLM `fp8` (`quant_method: "fp8"`)',
}
_SCHEME_NAMES = {
    "dynamic": "dynamic (FP8 weights and activations, activation scales computed per call)",
    "static": "static (FP8 weights and activations, calibrated activation scales)",
    "weight_only": "weight-only (FP8 weights, high-precision activations)",
}
_LIBRARY = {"hf_fp8": "hf-fp8"}
_FORMAT_TAGS = {"compressed-tensors": ["compressed-tensors", "vllm"], "vllm-fp8": ["vllm"]}


def default_template() -> str:
    """Text of the built-in card template, package data of ``hf_fp8.hub``
    (``hf_fp8/hub/templates/``), read with ``importlib.resources``: works from any install
    (``--user``, ``--prefix``, ``--target``, zip)."""
    resource = resources.files("hf_fp8.hub").joinpath("templates", TEMPLATE_NAME)
    try:
        return resource.read_text(encoding="utf-8")
    except (FileNotFoundError, OSError) as exc:
        raise FileNotFoundError(
            f"hf-fp8's model card template {TEMPLATE_NAME} is missing from the installed "
            f"package ({exc}): reinstall hf-fp8, or pass template=PATH"
        ) from exc


def _load_template(template: str | os.PathLike | None) -> jinja2.Template:
    if template is not None:
        path = Path(template)
        if not path.is_file():
            raise FileNotFoundError(f"model card template {path} does not exist")
        source, name = path.read_text(encoding="utf-8"), path.name
    else:
        source, name = default_template(), TEMPLATE_NAME
    env = jinja2.Environment(
        loader=jinja2.DictLoader({name: source}),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        autoescape=False,
    )
    env.filters["human_bytes"] = human_bytes
    env.filters["metric"] = _metric
    return env.get_template(name)


def human_bytes(n: int | float) -> str:
    """``1536`` → ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _metric(value: object) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def auto_class_name(architecture: str | None) -> str:
    """The ``transformers`` auto class that loads ``architecture`` (``AutoModel`` fallback)."""
    from transformers.models.auto import modeling_auto as auto

    for cls_name, mapping in (
        ("AutoModelForCausalLM", auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
        ("AutoModelForSeq2SeqLM", auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES),
        ("AutoModelForImageTextToText", auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES),
        ("AutoModelForMaskedLM", auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES),
        (
            "AutoModelForSequenceClassification",
            auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
        ),
        ("AutoModelForTokenClassification", auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES),
        ("AutoModelForQuestionAnswering", auto.MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES),
        ("AutoModel", auto.MODEL_MAPPING_NAMES),
    ):
        names = {n for v in mapping.values() for n in ((v,) if isinstance(v, str) else v)}
        if architecture in names:
            return cls_name
    return "AutoModel"


def card_metadata(info: CardInfo, tags: Iterable[str] = ()) -> ModelCardData:
    """Hub metadata: ``library_name``, tags ``fp8`` / ``hf_fp8``, ``base_model`` (+ relation)."""
    all_tags = list(dict.fromkeys([*TAGS, *_FORMAT_TAGS.get(info.format, []), *tags]))
    base = hub_model_id(info.base_model)
    data = ModelCardData(library_name=_LIBRARY.get(info.format, "transformers"), tags=all_tags)
    if base:
        data.base_model = base
        data.base_model_relation = "quantized"
    return data


def render_model_card(
    info: CardInfo,
    *,
    model_id: str | None = None,
    tags: Iterable[str] = (),
    template: str | os.PathLike | None = None,
) -> str:
    """Markdown of the model card (YAML metadata first). ``model_id`` is what the load
    snippet passes to ``from_pretrained`` (default ``info.repo_id``)."""
    model_id = model_id or info.repo_id or "path/to/this/model"
    base = hub_model_id(info.base_model)
    name = model_id.rstrip("/").rsplit("/", 1)[-1]
    high = info.high_precision_layers
    context = {
        "info": info,
        "metadata_yaml": card_metadata(info, tags).to_yaml(),
        "title": name if info.repo_id else f"{info.architecture or 'Model'} in FP8",
        "base_model": base,
        "base_model_url": f"https://huggingface.co/{base}" if base else None,
        "base_model_text": info.base_model if info.base_model and not base else None,
        "weight_words": (
            f"{info.scheme['fp8_format']} {weight_words(info.scheme)}" if info.scheme else "unknown"
        ),
        "activation_words": (
            activation_words(info.scheme, info.compute_dtype) if info.scheme else "unknown"
        ),
        "format_words": _FORMAT_WORDS.get(info.format, info.format),
        "scheme_name": _SCHEME_NAMES.get((info.scheme or {}).get("activation_scheme"), "unknown"),
        "high_precision_text": ", ".join(f"`{n}`" for n in high[:8])
        + (f" and {len(high) - 8} more" if len(high) > 8 else "")
        or "none",
        "auto_class": auto_class_name(info.architecture),
        "model_id": model_id,
        "export_dir": f"{name}-compressed-tensors",
        "import_dir": f"{name}-hf-fp8",
        "data_comment": f"{_DATA_START}{info.to_json()}{_DATA_END}",
    }
    return _load_template(template).render(**context)


def read_card_info(text: str) -> CardInfo | None:
    """The facts embedded in a card hf_fp8 rendered, else ``None``."""
    start = text.rfind(_DATA_START)
    if start < 0:
        return None
    end = text.find(_DATA_END, start + len(_DATA_START))
    try:
        return CardInfo.from_json(text[start + len(_DATA_START) : end])
    except (ValueError, TypeError):
        return None


def is_user_card(text: str | None) -> bool:
    """True for a card a person wrote: not rendered by hf_fp8, not a placeholder
    (:func:`is_placeholder_card`). A card written from huggingface_hub's template with any
    section, field or metadata filled in is the user's."""
    if not text or not text.strip():
        return False
    return read_card_info(text) is None and not is_placeholder_card(text)


def is_placeholder_card(text: str) -> bool:
    """Whether ``text`` is an auto-generated card with nothing of the user's in it:
    huggingface_hub's default template (or transformers' ``push_to_hub`` card built from it)
    whose every line is still the template's own, with at least one field left
    "[More Information Needed]" and no metadata but ``tags`` / ``library_name``. Replacing it
    loses nothing (its tags are carried over)."""
    try:
        card = ModelCard(text, ignore_metadata_errors=True)
    except Exception:  # unreadable: not recognisably a placeholder, so never replaced
        return False
    if set(card.data.to_dict()) - _AUTO_METADATA:
        return False
    lines = {line.strip() for line in card.text.splitlines()} - {""}
    known = _template_lines()
    return any(_UNFILLED in line for line in lines) and all(
        line in known or any(p.fullmatch(line) for p in _AUTO_PATTERNS) for line in lines
    )


@functools.lru_cache(maxsize=1)
def _template_lines() -> frozenset[str]:
    """The lines of huggingface_hub's installed default model card template, unfilled."""
    text = ModelCard.from_template(ModelCardData()).text
    return frozenset(line.strip() for line in text.splitlines())


def merge_card(
    existing: str | None, info: CardInfo, *, carry_figures: bool = True, **render_kwargs
) -> str:
    """The card to upload: a fresh rendering that keeps the existing card's tags and the
    facts an earlier hf_fp8 card recorded when it describes the same model
    (:func:`same_model`): its base model, and its fidelity figures when they were also measured
    in the compute dtype of ``info`` (:func:`same_compute_dtype`); a card the user wrote is
    kept as written, with hf_fp8's metadata added. ``carry_figures=False``: never the earlier
    card's fidelity figures (an export takes its source's, not those of the folder it
    replaces)."""
    old_tags: list[str] = []
    if existing:
        card = ModelCard(existing, ignore_metadata_errors=True)
        old_tags = list(card.data.tags or [])
        if is_user_card(existing):
            fresh = card_metadata(info, old_tags).to_dict()
            for key, value in fresh.items():
                if key == "tags" or card.data.get(key) is None:
                    card.data[key] = value
            return str(card)
        previous = read_card_info(existing)
        if previous is not None and same_model(previous, info):
            info.base_model = info.base_model or previous.base_model
            if carry_figures and same_compute_dtype(previous.compute_dtype, info.compute_dtype):
                info.fidelity = info.fidelity or previous.fidelity
    return render_model_card(info, tags=old_tags, **render_kwargs)


def same_model(previous: CardInfo, info: CardInfo) -> bool:
    """Whether an earlier card describes the model ``info`` describes, so that its facts
    (base model, measured fidelity) still hold: the same format and scheme, and the same base
    model, architecture and whole ``quantization_config`` (skips, weight scale method,
    activation scales, ...) where both cards record one, and the same static input scales
    when ``info`` records them (a card from a loaded static model: an earlier card that
    records none, or others, was measured with scales that may be gone, e.g. before a
    calibration). A different model saved into the same folder, or the same one quantized
    or calibrated otherwise, starts from a card without them."""

    def norm(value: Any) -> Any:
        return json.loads(json.dumps(value, sort_keys=True))

    def differ(a: Any, b: Any) -> bool:
        return a is not None and b is not None and norm(a) != norm(b)

    return (
        previous.format == info.format
        and norm(previous.scheme) == norm(info.scheme)
        and not differ(previous.base_model, info.base_model)
        and not differ(previous.architecture, info.architecture)
        and not differ(_quantization_config(previous), _quantization_config(info))
        and info.static_scales in (None, previous.static_scales)
        and info.static_scales != UNKNOWN_SCALES  # offloaded scales: maybe not the measured ones
    )


def same_compute_dtype(measured: str | None, current: str | None) -> bool:
    """Whether figures measured in compute dtype ``measured`` describe weights that compute
    in ``current``: the same dtype (FP8 fidelity depends on the high-precision dtype: relative
    L2 0.0802 in float32 is 0.0826 in bfloat16 for the same tiny model). A known dtype on one
    side only differs (an earlier card that records none, weights whose dtype is unknown);
    neither known (cards built by hand) is no sign of a change."""
    return measured == current


def _quantization_config(info: CardInfo) -> dict[str, Any] | None:
    """The ``quantization_config`` a card records (cards rendered from a checkpoint folder,
    or by an older hf_fp8, record none)."""
    return getattr(info, "quantization_config", None)


_READ = object()


def write_model_card(
    folder: str | os.PathLike,
    info: CardInfo,
    *,
    existing: str | object | None = _READ,
    **render_kwargs,
) -> Path:
    """Write ``README.md`` into ``folder``, merged with ``existing`` (default: the card already
    in ``folder``; pass the old folder's card when ``folder`` is a fresh temporary one). The
    card is read and replaced without following a link (``hf_fp8.hub.card_file``: a linked,
    special or oversized README.md raises ``UnsafePathError``)."""
    if existing is _READ:
        existing = read_card(folder)
    return write_card(folder, merge_card(existing, info, **render_kwargs))
