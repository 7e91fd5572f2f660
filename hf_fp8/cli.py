"""``hf-fp8``: quantize, calibrate, export, import, push and inspect FP8 checkpoints.

``main(argv) -> int`` runs in-process (tests call it); the console script wraps it. Every error
prints one line (``hf-fp8 <command>: error: …``) in command-line words and returns a non-zero
code; ``HF_FP8_TRACEBACK=1`` shows the traceback instead. Only the standard library and the
vocabularies (``hf_fp8.recipe``, ``hf_fp8.serialization.names``) load at import: torch and
transformers load inside the commands, so ``hf-fp8 --help`` is fast.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from hf_fp8.recipe import (
    DEFAULT_BLOCK_SIZE,
    ActivationGranularity,
    ActivationScheme,
    Fp8Format,
    Granularity,
    WeightScaleMethod,
    values,
)
from hf_fp8.serialization.names import COMPRESSED_TENSORS, EXPORT_FORMATS
from hf_fp8.serialization.printable import printable

DEFAULT_MODEL = "the built-in all-MiniLM-L6-v2"
_EXIT_USAGE, _EXIT_ERROR, _EXIT_INTERRUPTED = 2, 1, 130


class UsageError(Exception):
    """Bad command line; raised by the parsers instead of printing usage and exiting."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see {self.prog} --help)")


# -- models -----------------------------------------------------------------------------------------
def _model_path(model: str | None) -> str:
    if model:
        return model
    from hf_fp8.utils.minilm import default_model_path

    return default_model_path()


def _load(model_id: str, quantization_config: Any, dtype: str):
    """Load ``model_id`` (folder or repo id) with its own architecture class."""
    import transformers

    from hf_fp8.serialization.layers import registered_model_class

    config = transformers.AutoConfig.from_pretrained(model_id)
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = registered_model_class(config.model_type, arch) or transformers.AutoModel
    kwargs = {"dtype": dtype}
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    return cls.from_pretrained(model_id, **kwargs).eval()


def _tokenizer(model_id: str, required: bool):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_id)
    except (OSError, ValueError, TypeError) as err:
        if required:
            raise ValueError(f"{model_id} has no tokenizer to encode text with: {err}") from err
        return None
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token  # decoder-only models: pad batches with EOS
    return tokenizer


def _fp8_config(args: argparse.Namespace, scheme: str):
    from hf_fp8 import Fp8Config

    return Fp8Config(
        scheme,
        weight_granularity=args.weight_granularity,
        activation_granularity=args.activation_granularity,
        fp8_format=args.fp8_format,
        block_size=args.block_size,
        modules_to_not_convert=args.skip or None,
        activation_scale=getattr(args, "activation_scale", None),
        weight_scale_method=args.weight_scale_method,
    )


def _output_of(model, batch) -> Any:
    out = model(**batch)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def _measure(model, model_id: str, dtype: str, n: int) -> dict[str, Any]:
    """Relative L2 error and mean cosine of the outputs vs the unquantized model on ``n``
    stdlib sentences."""
    import torch

    from hf_fp8.utils.corpus import stdlib_sentences

    tokenizer = _tokenizer(model_id, required=True)
    base = _load(model_id, None, dtype)
    enc = tokenizer(
        stdlib_sentences(n, seed=1),
        padding=True,
        truncation=True,
        max_length=128,
        return_tensors="pt",
    )
    with torch.no_grad():
        ref, got = _output_of(base, enc).float(), _output_of(model, enc).float()
    mask = enc["attention_mask"].bool()
    ref, got = ref[mask], got[mask]
    cosine = torch.nn.functional.cosine_similarity(ref, got, dim=-1).mean()
    return {
        f"relative L2 error of outputs ({n} sentences)": round(
            float((got - ref).norm() / ref.norm()), 6
        ),
        f"mean cosine of outputs vs unquantized ({n} sentences)": round(float(cosine), 6),
    }


def _local_source(model_id: str) -> Path | None:
    path = Path(model_id).expanduser()
    return path if path.is_dir() else None


def _check_source(model_id: str) -> None:
    """A local source folder is checked before transformers reads it (it follows ``../``
    shard names and symlinks): only the folder's own files are read."""
    from hf_fp8.serialization.checkpoint import check_source_folder

    local = _local_source(model_id)
    if local is not None:
        check_source_folder(local)


def _out_dir(args: argparse.Namespace, model_id: str) -> Path:
    """``--out`` checked before anything is loaded: never the source folder, however spelled."""
    from hf_fp8.serialization.checkpoint import check_out_dir

    return check_out_dir(args.out, source=_local_source(model_id), overwrite=args.overwrite)


def _check_skip(model_id: str, skip: list[str] | None) -> None:
    """``--skip`` names that match no module of the model are a typo: refuse them."""
    if not skip:
        return
    import transformers

    from hf_fp8.modules import unmatched_patterns
    from hf_fp8.serialization.layers import build_meta_model

    model = build_meta_model(transformers.AutoConfig.from_pretrained(model_id).to_dict())
    missing = unmatched_patterns(model, skip)
    if missing:
        examples = [n for n, m in model.named_modules() if type(m).__name__.endswith("Linear")]
        raise ValueError(
            f"--skip {' '.join(missing)}: no module of {type(model).__name__} has that name "
            f"(linear layers are called e.g. {', '.join(examples[-2:]) or '-'})"
        )


def _companion_source(model_id: str) -> Path | None:
    """Folder holding ``model_id``'s other files (tokenizer, sentence-transformers pipeline):
    the folder itself, or the Hub snapshot of its small files (never its weights)."""
    local = _local_source(model_id)
    if local is not None:
        return local
    from huggingface_hub import snapshot_download

    try:
        try:
            from huggingface_hub import HfApi

            files = HfApi().list_repo_files(model_id)
            ignore = _companion_ignore(files, module_dirs=_hub_module_dirs(model_id, files))
        except Exception:  # offline: the cached snapshot is used as it is
            ignore = _WEIGHT_PATTERNS
        return Path(snapshot_download(model_id, ignore_patterns=ignore))
    except Exception:  # no network and not cached: the pipeline files cannot be copied
        print(f"note: could not fetch the other files of {model_id} (tokenizer, pipeline)")
        return None


# Offline fallback only (the Hub's patterns match at any depth: module weights go too).
_WEIGHT_PATTERNS = ["*.safetensors", "*.bin", "*.pt", "*.pth", "*.h5", "*.msgpack", "*.ckpt"]
_WEIGHT_PATTERNS += ["*.onnx", "*.onnx_data", "*.gguf", "onnx/*", "openvino/*", "original/*"]


def _hub_module_dirs(model_id: str, repo_files: Sequence[str]) -> set[str]:
    """The pipeline module folders the repo's ``modules.json`` names (none without one)."""
    if "modules.json" not in repo_files:
        return set()
    from huggingface_hub import hf_hub_download

    from hf_fp8.serialization.checkpoint import pipeline_module_dirs

    return pipeline_module_dirs(Path(hf_hub_download(model_id, "modules.json")).read_bytes())


def _companion_ignore(repo_files: Sequence[str], module_dirs: Iterable[str] = ()) -> list[str]:
    """``snapshot_download`` ignore patterns for a repo's files: exactly its weights but the
    pipeline modules' (``module_dirs``: ``2_Dense/`` … from ``modules.json``), which come
    along; the model's own (top level), other formats (``onnx/``) and other folders'
    (``checkpoint-500/``) stay out."""
    from hf_fp8.serialization.checkpoint import model_weight_files

    weights = model_weight_files(repo_files, module_dirs)
    return [re.sub(r"([*?\[])", r"[\1]", f) for f in weights]


def _save(model, args: argparse.Namespace, model_id: str, out: Path) -> None:
    """Write the FP8 model, its tokenizer, the source's other files (sentence-transformers
    ``modules.json``, ``1_Pooling/`` …) and the model card into ``out`` in one atomic step;
    files already in ``out`` that are not written are kept."""
    from hf_fp8.hub import info_from_model, set_card_info
    from hf_fp8.hub.card import merge_card
    from hf_fp8.hub.card_file import read_card
    from hf_fp8.serialization.checkpoint import CARD_NAME, copy_companion_files, output_folder

    if args.measure:
        fidelity = _measure(model, model_id, args.dtype, args.measure)
        set_card_info(model, fidelity=fidelity)
        for name, value in fidelity.items():
            print(f"{name}: {value}")
    if args.base_model:
        set_card_info(model, base_model=args.base_model)
    tokenizer = _tokenizer(model_id, required=False)
    source = _companion_source(model_id)
    with output_folder(out) as tmp:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if source is not None:
            copy_companion_files(source, tmp)
        old_card = read_card(out) if out.is_dir() else None  # a link, FIFO, huge file: refused
        # rendered again for out: save_pretrained(tmp) named the temporary folder in the card;
        # with --overwrite merged into out's card (the user's text in it is kept)
        card = merge_card(old_card, info_from_model(model), model_id=out.resolve().name)
        (tmp / CARD_NAME).write_text(card, encoding="utf-8")
    info = info_from_model(model)
    print(
        f"wrote {out}: {info.scheme_text}; {info.fp8_layers} FP8 layers; "
        f"{_bytes(info.bytes_before)} → {_bytes(info.bytes_after)}"
    )


def _bytes(n: int | None) -> str:
    from hf_fp8.hub.card import human_bytes

    return "?" if n is None else human_bytes(n)


def _read_samples(path: str, limit: int) -> list[str]:
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(
            f"--data {path}: no such file (give a .txt with one sample per line or a .jsonl with a 'text' field)"
        )
    lines = [ln for ln in file.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if file.suffix == ".jsonl":
        try:
            lines = [json.loads(ln)["text"] for ln in lines]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(
                f"--data {path}: every line must be a JSON object with a 'text' field"
            ) from err
    if not lines:
        raise ValueError(f"--data {path} holds no text")
    return lines[:limit]


# hf-fp8-autoload.pth registers hf_fp8 in every process of this install (README "Installed
# means loadable"); HF_FP8_AUTOLOAD=0 turns it off
NO_IMPORT_NEEDED = "(hf-fp8 installed: no `import hf_fp8` needed unless HF_FP8_AUTOLOAD=0)"


# -- commands ---------------------------------------------------------------------------------------
def cmd_quantize(args: argparse.Namespace) -> int:
    if args.scheme == "static" and args.activation_scale is None:
        raise ValueError(
            "static activations need scales: run `hf-fp8 calibrate MODEL --data FILE --out DIR` "
            "or pass --activation-scale"
        )
    model_id = _model_path(args.model)
    _check_source(model_id)
    out = _out_dir(args, model_id)
    _check_skip(model_id, args.skip)
    config = _fp8_config(args, args.scheme)
    _save(_load(model_id, config, args.dtype), args, model_id, out)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    import hf_fp8
    from hf_fp8.calibration import OBSERVERS

    if args.observer not in OBSERVERS:  # before anything is loaded
        raise ValueError(f"--observer {args.observer}: use one of {', '.join(OBSERVERS)}")
    if args.activation_granularity not in (None, ActivationGranularity.TENSOR.value):
        raise ValueError(
            f"--activation-granularity {args.activation_granularity}: calibrate computes static "
            "activation scales, one per tensor (drop the option, or pass "
            "--activation-granularity tensor); for per-token or block scales, computed per "
            "call, use dynamic activations: `hf-fp8 quantize MODEL --scheme dynamic "
            f"--activation-granularity {args.activation_granularity} --out DIR`"
        )
    samples = _read_samples(args.data, args.max_samples)
    model_id = _model_path(args.model)
    _check_source(model_id)
    out = _out_dir(args, model_id)
    _check_skip(model_id, args.skip)
    config = _fp8_config(args, "static")
    tokenizer = _tokenizer(model_id, required=True)
    batches = [
        tokenizer(
            samples[i : i + args.batch_size],
            padding=True,
            truncation=True,
            max_length=args.max_length,
            return_tensors="pt",
        )
        for i in range(0, len(samples), args.batch_size)
    ]
    model = _load(model_id, config, args.dtype)
    hf_fp8.calibrate(model, batches, observer=args.observer, progress=False)
    print(f"calibrated on {len(samples)} samples ({args.observer} observer)")
    _save(model, args, model_id, out)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from hf_fp8.serialization import export

    out = export(args.checkpoint, args.out, args.format, overwrite=args.overwrite)
    print(f"wrote {out} ({args.format})")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from hf_fp8.serialization import import_checkpoint

    out = import_checkpoint(args.checkpoint, args.out, overwrite=args.overwrite)
    print(f"wrote {out} (hf_fp8); load it with from_pretrained {NO_IMPORT_NEEDED}")
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    from hf_fp8.hub import push_folder
    from hf_fp8.serialization.checkpoint import folder_files

    if not Path(args.folder).is_dir():
        raise FileNotFoundError(
            f"{args.folder} is not a folder: push uploads a saved checkpoint folder"
        )
    folder_files(args.folder)  # refuses symlinks: only the folder's own files go up
    commit = push_folder(
        args.folder,
        args.repo_id,
        private=args.private or None,
        token=args.token,
        revision=args.revision,
        create_pr=args.create_pr,
        commit_message=args.commit_message,
        base_model=args.base_model,
    )
    print(f"pushed {args.folder} to {args.repo_id}: {getattr(commit, 'commit_url', commit)}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from hf_fp8.serialization import inspect_checkpoint

    summary = inspect_checkpoint(args.checkpoint, revision=args.revision)
    if args.json:
        print(json.dumps(summary.to_dict(), indent=2))
        return 0
    high = summary.high_precision_layers
    rows = [
        ("path", summary.path),
        ("format", summary.format),
        ("architecture", summary.architecture or "unknown"),
        ("scheme", summary.scheme_text),
        ("fp8 layers", str(len(summary.fp8_layers))),
        ("fp8 share", f"{summary.fp8_share:.1%} of {summary.parameters:,} parameters"),
        ("high precision", "unknown" if high is None else f"{len(high)}: {', '.join(high) or '-'}"),
        (
            "bytes",
            f"fp8 weights {_bytes(summary.fp8_weight_bytes)}, scales {_bytes(summary.scale_bytes)}, "
            f"other {_bytes(summary.other_bytes)}, total {_bytes(summary.total_bytes)}",
        ),
    ]
    rows += [
        ("kept", f"{p['what']}: {p['parameters']:,} ({p['why']})")
        for p in summary.high_precision_parts
    ]
    if summary.fp8_layers:
        rows.append(
            ("unquantized", f"{_bytes(summary.bytes_before)} ({summary.compute_dtype} weights)")
        )
    if summary.kv_cache_text:
        rows.append(("kv cache", summary.kv_cache_text))
    if summary.note:
        rows.append(("note", summary.note))
    for key, value in rows:  # names and values from the checkpoint: escapes shown, not run
        print(f"{key:<15} {printable(value)}")
    return 0


# -- parser -----------------------------------------------------------------------------------------
def _add_out(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="output folder: new or empty (never the source folder); written all at once",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty --out: replaces only the files this command writes "
        "(weights, config, card …) and keeps the others (LoRA adapters, notes …)",
    )


def _add_recipe(p: argparse.ArgumentParser, *, static_only: bool = False) -> None:
    """The options every quantizing command takes; ``static_only``: ``hf-fp8 calibrate``,
    whose activation scales are static, one per tensor (its only granularity)."""
    p.add_argument(
        "model", nargs="?", help=f"local folder or Hub repo id (default: {DEFAULT_MODEL})"
    )
    _add_out(p)
    p.add_argument(
        "--weight-granularity",
        default=Granularity.ROW.value,
        choices=values(Granularity),
        help="one weight scale per tensor, per output row (default) or per block",
    )
    if static_only:
        p.add_argument(
            "--activation-granularity",
            default=None,
            choices=values(ActivationGranularity),
            help="static activations: one calibrated scale per tensor (tensor: the default and "
            "the only choice; per-token or block scales are dynamic: `hf-fp8 quantize "
            "--scheme dynamic`)",
        )
    else:
        p.add_argument(
            "--activation-granularity",
            default=None,
            choices=values(ActivationGranularity),
            help="--scheme dynamic: one scale per token (default), per tensor or per 1×COLS "
            "block; --scheme static: per tensor (default, the only choice)",
        )
    p.add_argument(
        "--fp8-format",
        default=Fp8Format.E4M3.value,
        choices=values(Fp8Format),
        help="e4m3 (default: more precision) or e5m2 (more range)",
    )
    p.add_argument(
        "--weight-scale-method",
        default=WeightScaleMethod.ABSMAX.value,
        choices=values(WeightScaleMethod),
        help="absmax (default) or mse (clip weights to minimise the squared error)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        nargs=2,
        default=list(DEFAULT_BLOCK_SIZE),
        metavar=("ROWS", "COLS"),
        help="block shape for --weight-granularity block / --activation-granularity block "
        f"(default {DEFAULT_BLOCK_SIZE[0]} {DEFAULT_BLOCK_SIZE[1]})",
    )
    p.add_argument(
        "--skip",
        nargs="+",
        metavar="MODULE",
        help="modules kept in high precision (a name or a dotted part of one, e.g. lm_head)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help="compute dtype: auto (checkpoint's), bfloat16, float16, float32",
    )
    p.add_argument(
        "--measure",
        type=int,
        default=0,
        metavar="N",
        help="compare with the unquantized model on N stdlib sentences; the figures go in the model card",
    )
    p.add_argument("--base-model", help="Hub id of the original model, for the model card")


def _positive_int(text: str) -> int:
    """argparse type of ``hf-fp8 calibrate``'s counts: an integer of at least 1 (R27: 0 and
    negative values crashed deep inside, or silently dropped a sample)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a whole number of at least 1, got {text!r}"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hf-fp8", description="FP8 checkpoints for the Hugging Face stack.")
    sub = parser.add_subparsers(
        dest="command", required=True, parser_class=_Parser, metavar="COMMAND"
    )

    p = sub.add_parser(
        "quantize",
        help="quantize a model to FP8 and save it",
        description="Quantize MODEL to FP8 (on the fly) and save the FP8 checkpoint, tokenizer, "
        "the model's other files (e.g. a sentence-transformers pipeline) and a model card.",
    )
    _add_recipe(p)
    p.add_argument(
        "--scheme",
        default=ActivationScheme.DYNAMIC.value,
        choices=values(ActivationScheme),
        help="activations: dynamic (default: scales per call), static (one calibrated scale "
        "per layer: use `hf-fp8 calibrate` or --activation-scale) or weight_only (not quantized)",
    )
    p.add_argument(
        "--activation-scale",
        type=float,
        metavar="SCALE",
        help="static: one activation scale for every layer",
    )
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser(
        "calibrate",
        help="static FP8: activation scales from a text file",
        description="Quantize MODEL with static FP8 activations, calibrate the scales on --data, save.",
    )
    _add_recipe(p, static_only=True)
    p.add_argument(
        "--data",
        required=True,
        metavar="FILE",
        help=".txt (one sample per line) or .jsonl ('text' field)",
    )
    p.add_argument(
        "--observer",
        default="minmax",
        help="how activation ranges become scales: minmax (default), moving_average, "
        "percentile or mse (see hf_fp8.calibration.OBSERVERS)",
    )
    p.add_argument(
        "--batch-size", type=_positive_int, default=8, help="samples per batch (default 8)"
    )
    p.add_argument(
        "--max-samples",
        type=_positive_int,
        default=512,
        help="samples read from --data (default 512)",
    )
    p.add_argument(
        "--max-length",
        type=_positive_int,
        default=512,
        help="tokens per sample, truncated (default 512)",
    )
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser(
        "export",
        help="hf_fp8 → compressed-tensors / vLLM fp8",
        description="Convert an hf_fp8 checkpoint (folder or repo id) for vLLM, SGLang, TGI "
        "(compressed-tensors) or vLLM's fp8 format; other files and a model card come along.",
    )
    p.add_argument("checkpoint", help="hf_fp8 checkpoint folder or Hub repo id")
    p.add_argument(
        "--format",
        default=COMPRESSED_TENSORS,
        choices=EXPORT_FORMATS,
        help="compressed-tensors (default: vLLM, SGLang, TGI, transformers) or vllm-fp8 "
        "(per-tensor or block weights)",
    )
    _add_out(p)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "import",
        help="compressed-tensors / vLLM fp8 → hf_fp8",
        description="Convert an FP8 compressed-tensors or vLLM fp8 checkpoint into an hf_fp8 checkpoint (same FP8 numbers).",
    )
    p.add_argument("checkpoint", help="checkpoint folder or Hub repo id")
    _add_out(p)
    p.set_defaults(func=cmd_import)

    p = sub.add_parser(
        "push",
        help="upload a checkpoint folder with its model card",
        description="Upload FOLDER to the Hub repo REPO_ID (created if needed) with a model "
        "card, in one commit. Hidden files are left out; a symlink in FOLDER is refused.",
    )
    p.add_argument("folder", help="the checkpoint folder to upload")
    p.add_argument("repo_id", help="Hub repo id, e.g. your-name/model-fp8")
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--revision", help="branch to push to")
    p.add_argument("--create-pr", action="store_true", help="open a pull request instead")
    p.add_argument("--commit-message", help="commit message (default: Upload FP8 model)")
    p.add_argument("--base-model", help="Hub id of the original model, for the model card")
    p.add_argument("--token", help="Hub token (default: the stored login)")
    p.set_defaults(func=cmd_push)

    p = sub.add_parser(
        "inspect",
        help="format, scheme, layers and bytes of a checkpoint",
        description="Show format, FP8 scheme, layers and bytes of a checkpoint (reads tensor "
        "headers only; for a Hub repo id nothing but config.json is downloaded).",
    )
    p.add_argument("checkpoint", help="checkpoint folder or Hub repo id")
    p.add_argument("--revision", help="Hub branch, tag or commit (repo ids only)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)
    return parser


# -- errors -----------------------------------------------------------------------------------------
# Library messages name keyword arguments; the command line has options.
_OPTION_OF = {
    "format": "--format",
    "overwrite": "--overwrite",
    "weight_granularity": "--weight-granularity",
    "activation_granularity": "--activation-granularity",
    "activation_scheme": "--scheme",
    "fp8_format": "--fp8-format",
    "block_size": "--block-size",
    "modules_to_not_convert": "--skip",
    "weight_scale_method": "--weight-scale-method",
    "observer": "--observer",
}
_NAMES = "|".join(_OPTION_OF)
# a list, a quoted string, or a bare word (up to , ; ) or a space: "weight_granularity='row';")
_VALUE = r"(\[[^\]]*\]|'[^']*'|\"[^\"]*\"|[^,;)\s]*)"
_KWARG = re.compile(rf"(?:hf_fp8\.)?Fp8Config\(\b({_NAMES})={_VALUE}\)|\b({_NAMES})={_VALUE}")


def _cli_words(text: str) -> str:
    """``overwrite=True`` → ``--overwrite``; ``Fp8Config(fp8_format='e4m3')`` →
    ``--fp8-format e4m3``; ``format='compressed-tensors'`` → ``--format compressed-tensors``."""

    def option(match: re.Match) -> str:
        key, value = match.group(1) or match.group(3), match.group(2) or match.group(4) or ""
        flag, value = _OPTION_OF[key], value.strip("'\"")
        if value == "True":
            return flag
        value = " ".join(value.strip("[]").replace(",", " ").split())
        return f"{flag} {value}" if value else flag

    return _KWARG.sub(option, text)


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 400 else text[:397] + "..."


def _message(err: BaseException) -> str:
    """One line for the user: what went wrong and the fix, in command-line words."""
    from_lib = err.__class__.__module__.split(".")[0]
    name = type(err).__name__
    if name == "OutputExistsError":
        return (
            f"{err.filename} is not empty: choose a new --out, or use --overwrite (only the "
            "files this command writes are replaced; the others are kept)"
        )
    if "OfflineMode" in name:  # the advice below is already in effect and cannot help
        return (
            f"HF_HUB_OFFLINE is set, so the Hugging Face Hub is not contacted ({name}: "
            f"{_one_line(err)}): unset HF_HUB_OFFLINE (or set it to 0) to upload or download"
        )
    if any(word in name for word in ("Connect", "Timeout")):
        return (
            f"cannot reach the Hugging Face Hub ({name}: {_one_line(err)}): check the network, "
            "or set HF_HUB_OFFLINE=1 to use the local cache"
        )
    text = _cli_words(_one_line(err))
    builtin = from_lib == "builtins" or name in ("UnsafePathError", "CheckpointTensorError")
    return text if builtin else f"{name}: {text}"


def _printable_warnings(show: Any) -> Any:
    """``warnings.showwarning`` that passes ``show`` the message with its non-printable
    characters escaped: warnings name a checkpoint's tensors and layers (R41 F2)."""

    def showwarning(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if not text.isprintable():
            message = printable(text)
        return show(message, category, filename, lineno, file, line)

    return showwarning


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``hf-fp8`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code.
    Messages that quote a checkpoint (errors, warnings) show its control characters
    escaped (``\\x1b``), never send them to the terminal."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
    except UsageError as err:
        print(f"hf-fp8: error: {printable(_one_line(err))}", file=sys.stderr)
        return _EXIT_USAGE
    except SystemExit as done:  # --help
        return int(done.code or 0)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _printable_warnings(warnings.showwarning)
            return args.func(args)
    except KeyboardInterrupt:
        print(f"hf-fp8 {args.command}: interrupted (nothing was written)", file=sys.stderr)
        return _EXIT_INTERRUPTED
    except Exception as err:
        if os.environ.get("HF_FP8_TRACEBACK"):
            raise
        print(f"hf-fp8 {args.command}: error: {printable(_message(err))}", file=sys.stderr)
        return _EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
