"""``hf-fp8``: quantize, calibrate, export, import, push and inspect FP8 checkpoints.

``main(argv) -> int`` runs in-process (tests call it); the console script wraps it. Errors
print one line (``hf-fp8 <command>: error: …``) and return a non-zero code.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "the built-in all-MiniLM-L6-v2"
_EXIT_USAGE, _EXIT_ERROR = 2, 1


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

    config = transformers.AutoConfig.from_pretrained(model_id)
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    cls = cls if cls is not None else transformers.AutoModel
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


def _out_dir(args: argparse.Namespace) -> Path:
    from hf_fp8.serialization.checkpoint import prepare_out_dir

    return prepare_out_dir(args.out, overwrite=args.overwrite)


def _save(model, args: argparse.Namespace, model_id: str, out: Path) -> None:
    from hf_fp8.hub import info_from_model, set_card_info

    if args.measure:
        fidelity = _measure(model, model_id, args.dtype, args.measure)
        set_card_info(model, fidelity=fidelity)
        for name, value in fidelity.items():
            print(f"{name}: {value}")
    if args.base_model:
        set_card_info(model, base_model=args.base_model)
    model.save_pretrained(out)
    tokenizer = _tokenizer(model_id, required=False)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    info = info_from_model(model)
    print(
        f"wrote {out}: {info.scheme_text}; {info.fp8_layers} FP8 layers; {_bytes(info.bytes_before)} → {_bytes(info.bytes_after)}"
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


# -- commands ---------------------------------------------------------------------------------------
def cmd_quantize(args: argparse.Namespace) -> int:
    if args.scheme == "static" and args.activation_scale is None:
        raise ValueError(
            "static activations need scales: run `hf-fp8 calibrate MODEL --data FILE --out DIR` "
            "or pass --activation-scale"
        )
    model_id = _model_path(args.model)
    config = _fp8_config(args, args.scheme)
    out = _out_dir(args)
    _save(_load(model_id, config, args.dtype), args, model_id, out)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    import hf_fp8

    samples = _read_samples(args.data, args.max_samples)
    model_id = _model_path(args.model)
    config = _fp8_config(args, "static")
    out = _out_dir(args)
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
    from hf_fp8.hub import export

    out = export(args.checkpoint, args.out, args.format, overwrite=args.overwrite)
    print(f"wrote {out} ({args.format})")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from hf_fp8.serialization import import_checkpoint

    out = import_checkpoint(args.checkpoint, args.out, overwrite=args.overwrite)
    print(f"wrote {out} (hf_fp8); load it after `import hf_fp8`")
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    from hf_fp8.hub import push_folder

    if not Path(args.folder).is_dir():
        raise FileNotFoundError(
            f"{args.folder} is not a folder: push uploads a saved checkpoint folder"
        )
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

    summary = inspect_checkpoint(args.checkpoint)
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
        ("high precision", "unknown" if high is None else f"{len(high)}: {', '.join(high) or '-'}"),
        (
            "bytes",
            f"fp8 weights {_bytes(summary.fp8_weight_bytes)}, scales {_bytes(summary.scale_bytes)}, "
            f"other {_bytes(summary.other_bytes)}, total {_bytes(summary.total_bytes)}",
        ),
    ]
    if summary.fp8_layers:
        rows.append(
            ("unquantized", f"{_bytes(summary.bytes_before)} ({summary.compute_dtype} weights)")
        )
    if summary.note:
        rows.append(("note", summary.note))
    for key, value in rows:
        print(f"{key:<15} {value}")
    return 0


# -- parser -----------------------------------------------------------------------------------------
def _add_recipe(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model", nargs="?", help=f"local folder or Hub repo id (default: {DEFAULT_MODEL})"
    )
    p.add_argument("--out", required=True, help="output folder (must be new or empty)")
    p.add_argument("--weight-granularity", default="row", choices=["row", "tensor", "block"])
    p.add_argument(
        "--activation-granularity",
        default=None,
        choices=["token", "tensor", "block"],
        help="dynamic activations: token (default), tensor or block",
    )
    p.add_argument("--fp8-format", default="e4m3", choices=["e4m3", "e5m2"])
    p.add_argument("--block-size", type=int, nargs=2, default=[128, 128], metavar=("ROWS", "COLS"))
    p.add_argument("--skip", nargs="+", metavar="MODULE", help="modules kept in high precision")
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
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hf-fp8", description="FP8 checkpoints for the Hugging Face stack.")
    sub = parser.add_subparsers(
        dest="command", required=True, parser_class=_Parser, metavar="COMMAND"
    )

    p = sub.add_parser(
        "quantize",
        help="quantize a model to FP8 and save it",
        description="Quantize MODEL to FP8 (on the fly) and save the FP8 checkpoint, tokenizer and model card.",
    )
    _add_recipe(p)
    p.add_argument("--scheme", default="dynamic", choices=["dynamic", "static", "weight_only"])
    p.add_argument("--activation-scale", type=float, help="static: one scale for every layer")
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser(
        "calibrate",
        help="static FP8: activation scales from a text file",
        description="Quantize MODEL with static FP8 activations, calibrate the scales on --data, save.",
    )
    _add_recipe(p)
    p.add_argument(
        "--data", required=True, help=".txt (one sample per line) or .jsonl ('text' field)"
    )
    p.add_argument(
        "--observer", default="minmax", choices=["minmax", "moving_average", "percentile", "mse"]
    )
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-samples", type=int, default=512)
    p.add_argument("--max-length", type=int, default=512)
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser(
        "export",
        help="hf_fp8 → compressed-tensors / vLLM fp8",
        description="Convert an hf_fp8 checkpoint (folder or repo id) for vLLM, SGLang, TGI (compressed-tensors) or vLLM's fp8 format.",
    )
    p.add_argument("checkpoint", help="hf_fp8 checkpoint folder or Hub repo id")
    p.add_argument(
        "--format", default="compressed-tensors", choices=["compressed-tensors", "vllm-fp8"]
    )
    p.add_argument("--out", required=True, help="output folder (must be new or empty)")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "import",
        help="compressed-tensors / vLLM fp8 → hf_fp8",
        description="Convert an FP8 compressed-tensors or vLLM fp8 checkpoint into an hf_fp8 checkpoint (same FP8 numbers).",
    )
    p.add_argument("checkpoint", help="checkpoint folder or Hub repo id")
    p.add_argument("--out", required=True, help="output folder (must be new or empty)")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser(
        "push",
        help="upload a checkpoint folder with its model card",
        description="Upload FOLDER to the Hub repo REPO_ID (created if needed) with a model card, in one commit.",
    )
    p.add_argument("folder")
    p.add_argument("repo_id")
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--revision", help="branch to push to")
    p.add_argument("--create-pr", action="store_true")
    p.add_argument("--commit-message")
    p.add_argument("--base-model", help="Hub id of the original model, for the model card")
    p.add_argument("--token", help="Hub token (default: the stored login)")
    p.set_defaults(func=cmd_push)

    p = sub.add_parser(
        "inspect",
        help="format, scheme, layers and bytes of a checkpoint",
        description="Show format, FP8 scheme, layers and bytes of a checkpoint (reads tensor headers only).",
    )
    p.add_argument("checkpoint", help="checkpoint folder or Hub repo id")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)
    return parser


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 400 else text[:397] + "..."


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``hf-fp8`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
    except UsageError as err:
        print(f"hf-fp8: error: {_one_line(err)}", file=sys.stderr)
        return _EXIT_USAGE
    except SystemExit as done:  # --help
        return int(done.code or 0)
    try:
        return args.func(args)
    except (ValueError, TypeError, OSError, ImportError, RuntimeError) as err:
        print(f"hf-fp8 {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return _EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
