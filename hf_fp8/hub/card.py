"""Model cards: render ``hf_fp8/hub/templates/hf_fp8_model_card.md.j2`` (Jinja2, package data),
embed the facts so a later push can re-render them, and respect cards the user wrote.

hf_fp8 writes its part of a card between two marker lines, ``<!-- hf_fp8:begin ... -->`` and
``<!-- hf_fp8:end sha256:<digest> -->`` (the digest of what it wrote there), and of the YAML
metadata only its own keys (``library_name``, ``tags``, ``base_model``,
``base_model_relation``). A later render (:func:`merge_card`) replaces that part only, and only
when it is still what hf_fp8 wrote: text the user wrote around it, and metadata keys and values
the user set, stay byte for byte (a BOM and CRLF line endings included). A card whose marked
part the user edited, or whose markers are not as hf_fp8 wrote them, is kept as it is (hf_fp8's
missing metadata keys added) with one warning that names the fix. A card of an older hf_fp8
(no markers) is re-rendered around the user's additions when its generated text is found
unchanged in it, else kept whole with the new part added after it (one warning).
"""

from __future__ import annotations

import functools
import json
import os
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2
from huggingface_hub import ModelCard, ModelCardData

from hf_fp8.config import Fp8Config
from hf_fp8.hub.card_file import (
    BEGIN_MARKER,
    END_MARKER,
    FRONT_MATTER,
    MarkedPart,
    digest,
    find_marked_part,
    marked_part,
    merge_metadata,
    normal_text,
    read_card,
    split_card,
    warn_card,
    write_card,
)
from hf_fp8.hub.card_info import UNKNOWN_SCALES, CardInfo, hub_model_id
from hf_fp8.serialization import compressed_tensors
from hf_fp8.serialization.layers import LayerPlan
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
    "vllm-fp8": 'vLLM `fp8` (`quant_method: "fp8"`)',
}
_SCHEME_NAMES = {
    "dynamic": "dynamic (FP8 weights and activations, activation scales computed per call)",
    # a scale given in the config (activation_scale=) is not calibrated (R25 F3)
    "static": "static (FP8 weights and activations, static activation scales: given or calibrated)",
    "weight_only": "weight-only (FP8 weights, high-precision activations)",
}
_LIBRARY = {"hf_fp8": "hf-fp8"}
_FORMAT_TAGS = {"compressed-tensors": ["compressed-tensors", "vllm"], "vllm-fp8": ["vllm"]}
# the experts module named in the exporter's words when a card stands in for the model
_EXPERTS = "its MoE experts"


@dataclass(frozen=True)
class Serving:
    """What the compressed-tensors exporter says about a card's model (R25 F3)."""

    export: bool  # `hf-fp8 export --format compressed-tensors` accepts its scheme
    vllm: bool  # and vLLM loads that export (for a compressed-tensors card: this checkpoint)
    why: str | None = None  # the exporter's words when either is false


def serving(info: CardInfo) -> Serving:
    """Ask the exporter, not a copy of its rules: ``compressed_tensors.export_config`` (what
    ``hf-fp8 export`` runs) on ``info``'s scheme, with FP8 MoE experts when ``info`` has
    them. It raises ``ValueError`` for what it does not export (e5m2; FP8 experts in a pair
    vLLM's fused-MoE loader refuses) and warns, naming vLLM, for an export vLLM refuses
    (block weights with static activations; weight-only FP8 experts). The checks that depend
    on tensors (block sizes that split experts, ...) are left to the export itself."""
    scheme = info.scheme
    if not scheme:
        return Serving(False, False, "its FP8 scheme is unknown")
    try:
        config = Fp8Config(
            scheme["activation_scheme"],
            weight_granularity=scheme["weight_granularity"],
            activation_granularity=scheme.get("activation_granularity"),
            fp8_format=scheme["fp8_format"],
            block_size=tuple(scheme["block_size"]),
        )
    except (KeyError, TypeError, ValueError) as err:
        return Serving(False, False, f"its FP8 scheme is not one hf-fp8 knows ({err})")
    experts = {f"{_EXPERTS}.0.gate_proj": _EXPERTS} if info.fp8_experts else {}
    plan = LayerPlan(fp8={}, high_precision=[], conv1d=[], fp8_experts=experts)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            compressed_tensors.export_config(config, plan)
        except ValueError as err:
            return Serving(False, False, _exporter_words(err))
    refused = [str(w.message) for w in caught if "vLLM" in str(w.message)]
    return Serving(True, not refused, _exporter_words(refused[0]) if refused else None)


def _exporter_words(message: object) -> str:
    text = " ".join(str(message).split()).removeprefix("compressed-tensors export: ")
    return text.rstrip(".")


def format_words(info: CardInfo, serve: Serving) -> str:
    """The card's Format row: the tensors hf_fp8's format holds for this scheme (an
    ``input_scale`` only with static activations); who loads a compressed-tensors one."""
    if info.format == "hf_fp8":
        static = (info.scheme or {}).get("activation_scheme") == "static"
        scales = "`weight_scale` / `input_scale`" if static else "`weight_scale`"
        return f'hf_fp8 (`quant_method: "hf_fp8"`): fp8 `weight`, fp32 {scales}'
    if info.format == "compressed-tensors":
        who = "vLLM, SGLang, TGI, transformers" if serve.vllm else "transformers; not vLLM"
        return f"compressed-tensors `float-quantized` ({who})"
    return _FORMAT_WORDS.get(info.format, info.format)


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
    format_tags = _FORMAT_TAGS.get(info.format, [])
    if info.format == "compressed-tensors" and not serving(info).vllm:
        format_tags = [t for t in format_tags if t != "vllm"]
    all_tags = list(dict.fromkeys([*TAGS, *format_tags, *tags]))
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
    """Markdown of the model card (YAML metadata first), the generated text between hf_fp8's
    markers. ``model_id`` is what the load snippet passes to ``from_pretrained`` (default
    ``info.repo_id``)."""
    head, body = _render_parts(info, model_id=model_id, tags=tags, template=template)
    return f"{head}\n{marked_part(body)}" if head else marked_part(body)


def _render_parts(
    info: CardInfo,
    *,
    model_id: str | None = None,
    tags: Iterable[str] = (),
    template: str | os.PathLike | None = None,
) -> tuple[str, str]:
    """The template's rendering split into its YAML block (with its ``---`` lines; ``""``
    when the template writes none) and the text after it."""
    model_id = model_id or info.repo_id or "path/to/this/model"
    base = hub_model_id(info.base_model)
    name = model_id.rstrip("/").rsplit("/", 1)[-1]
    high = info.high_precision_layers
    serve = serving(info)
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
        "format_words": format_words(info, serve),
        "serve": serve,
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
    text = _load_template(template).render(**context)
    match = FRONT_MATTER.match(text)
    return (text[: match.end()], text[match.end() :]) if match else ("", text)


def read_card_info(text: str) -> CardInfo | None:
    """The facts embedded in a card hf_fp8 rendered (in its marked part when the card has a
    valid one), else ``None``."""
    found = find_marked_part(split_card(text).body) if text else None
    if isinstance(found, MarkedPart):
        text = found.content
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
    """The lines of huggingface_hub's installed default model card template, unfilled, and
    those of its 0.14 - 0.17 versions: the same lines but two guidance comments that said
    "Data Card" where today's say "Dataset Card" (and one field fewer, "Funded by"), checked
    with ``git diff v0.14.0 v0.19.0 -- src/huggingface_hub/templates/modelcard_template.md``.
    (Older versions differ in headings and a table of contents: their cards count as the
    user's and are kept.)"""
    text = ModelCard.from_template(ModelCardData()).text
    lines = {line.strip() for line in text.splitlines()}
    return frozenset(lines | {line.replace("Dataset Card", "Data Card") for line in lines})


def merge_card(
    existing: str | None, info: CardInfo, *, carry_figures: bool = True, **render_kwargs
) -> str:
    """The card to write: hf_fp8's part rendered afresh in ``existing`` (see the module
    docstring for what is kept and when a card is kept as it is, with one warning). The facts
    an earlier hf_fp8 card recorded are carried over when it describes the same model
    (:func:`same_model`): its base model, and its fidelity figures when they were also
    measured in the compute dtype of ``info`` (:func:`same_compute_dtype`).
    ``carry_figures=False``: never the earlier card's fidelity figures (an export takes its
    source's, not those of the folder it replaces). A placeholder card
    (:func:`is_placeholder_card`) is replaced, keeping its tags."""
    if not existing or not existing.strip():
        return render_model_card(info, **render_kwargs)
    if is_placeholder_card(existing):
        old_tags = ModelCard(existing, ignore_metadata_errors=True).data.tags or []
        return render_model_card(info, tags=list(old_tags), **render_kwargs)
    parts = split_card(existing)
    found = find_marked_part(parts.body)
    previous = read_card_info(existing)
    if previous is not None and same_model(previous, info):
        info.base_model = info.base_model or previous.base_model
        if carry_figures and same_compute_dtype(previous.compute_dtype, info.compute_dtype):
            info.fidelity = info.fidelity or previous.fidelity
    _, fresh = _render_parts(info, **render_kwargs)
    region = marked_part(fresh, parts.newline)
    body, ours = parts.body, previous  # ours: whose metadata values hf_fp8 may update
    if isinstance(found, MarkedPart):
        if found.digest == digest(found.content) or not normal_text(found.content):
            body = body[: found.start] + region + body[found.end :]
        else:
            ours = None
            warn_card(
                f"README.md's generated part (between its {BEGIN_MARKER} --> and "
                f"{END_MARKER} --> lines) was edited after hf-fp8 wrote it, so the card is kept "
                "as it is and that part is not updated: its facts may be out of date. To let "
                "hf-fp8 update it, move your text above or below the two marker lines and "
                "delete what lies between them (keep the marker lines)"
            )
    elif found is not None:
        ours = None
        warn_card(
            f"README.md's hf_fp8 markers are not as hf-fp8 wrote them ({found}), so the card is "
            "kept as it is and its generated part is not updated. To fix: keep exactly one "
            f"{BEGIN_MARKER} --> line and one {END_MARKER} --> line after it, outside code "
            "blocks and mentioned nowhere else, with your own text above or below them (an "
            "empty pair is filled in on the next save)"
        )
    elif previous is not None:  # an hf_fp8 card without markers: an older hf_fp8 wrote it
        span = _old_generated_span(parts.body, previous, render_kwargs)
        if span is not None:
            body = body[: span[0]] + region + body[span[1] :]
        else:
            gap = parts.newline * (1 + (not body.endswith("\n")))
            body = f"{body}{gap}{region}"
            warn_card(
                "README.md was written by an older hf_fp8 (without hf_fp8:begin / hf_fp8:end "
                "markers) and edited since: every line of it is kept and hf-fp8's updated part "
                "is added after it, between markers. Delete the old generated text (from its "
                "title to its '<!-- hf_fp8 card data' line) if you do not need it; from now on "
                "only the part between the markers is rewritten"
            )
    wrote = card_metadata(ours).to_dict() if ours is not None else None
    head = merge_metadata(parts, card_metadata(info).to_dict(), wrote)
    return f"{parts.bom}{head}{body}"


def _old_generated_span(
    body: str, previous: CardInfo, render_kwargs: dict[str, Any]
) -> tuple[int, int] | None:
    """Where ``body`` (of a card without markers) holds, unchanged, the text hf_fp8 renders
    for ``previous`` (for one of the model ids the card names): ``(start, end)`` offsets of
    its lines; ``None`` when it is not there (edited, or another template)."""
    names = re.findall(r'from_pretrained\("([^"\n]+)"\)|vllm serve (\S+)', body)
    candidates = [render_kwargs.get("model_id"), previous.repo_id, None]
    candidates += list(dict.fromkeys(a or b for a, b in names))[:8]
    lines = body.splitlines(keepends=True)
    normal = [line.rstrip() for line in lines]
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    kwargs = {k: v for k, v in render_kwargs.items() if k != "model_id"}
    for model_id in dict.fromkeys(candidates):
        _, expected = _render_parts(previous, model_id=model_id, **kwargs)
        want = normal_text(expected).split("\n")
        if want == [""]:
            return None
        for i, line in enumerate(normal):
            if line == want[0] and normal[i : i + len(want)] == want:
                return starts[i], starts[i + len(want)]
    return None


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
