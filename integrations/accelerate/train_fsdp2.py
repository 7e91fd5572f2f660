"""Full fine-tuning of a causal LM with ``AdamWFp8`` (FP8 Adam moments, COAT) under FSDP2.

    accelerate launch --config_file integrations/accelerate/fsdp2.yaml \\
        integrations/accelerate/train_fsdp2.py [--model PATH] [--steps 20] [--save-every 10]
    python integrations/accelerate/train_fsdp2.py ...          # the same run in one process

Without ``--model`` it trains a small Llama (random init, bytes as tokens) on Python
standard-library source, so it runs anywhere, CPU included. The global batch is split across
ranks (``split_batches=True``), so any number of processes sees the same data per step and
gives the same loss curve. ``accelerator.save_state`` writes a sharded
``torch.distributed.checkpoint`` (model, FP8 optimizer states, scheduler, step);
``--resume-from DIR`` continues from one.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DataLoaderConfiguration, DistributedType, set_seed
from torch.utils.data import DataLoader
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
    get_cosine_schedule_with_warmup,
)

import hf_fp8
from hf_fp8.utils.corpus import stdlib_source_text
from hf_fp8.utils.tiny import tiny_llama_config


class Progress:
    """The optimizer step reached; saved and restored with the checkpoint."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def make_accelerator() -> Accelerator:
    """``Accelerator`` for the launch config; on machines without a GPU FSDP2 runs over gloo.

    accelerate 1.15 only enables FSDP for accelerator devices: on a CPU-only machine a
    ``distributed_type: FSDP`` launch silently becomes ``DistributedType.NO`` and each rank
    trains alone. Here we start the gloo process group ourselves (``cpu=True``) and label
    it a multi-device run, so accelerate's own FSDP2 path (``fully_shard``, sharded
    checkpoints) runs unchanged. Nothing changes on GPU machines.
    """
    fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if fsdp and "LOCAL_RANK" in os.environ and not torch.accelerator.is_available():
        PartialState(cpu=True)._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    return Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=True))


def build_model(args: argparse.Namespace) -> tuple[torch.nn.Module, PreTrainedTokenizerBase | None]:
    """The model to fine-tune and its tokenizer (``None``: bytes are the tokens)."""
    torch.manual_seed(args.seed)  # every rank starts from the same weights
    if args.model:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        return AutoModelForCausalLM.from_pretrained(args.model), tokenizer
    config = tiny_llama_config(args.hidden, args.layers, args.seq_len)
    return LlamaForCausalLM(config), None


def token_chunks(
    args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase | None, n_chunks: int
) -> torch.Tensor:
    """``[n_chunks, seq_len]`` token ids of stdlib source, in a fixed shuffled order."""
    text = stdlib_source_text(max_chars=n_chunks * args.seq_len * 8)
    ids = tokenizer(text)["input_ids"] if tokenizer else list(text.encode("utf-8"))
    usable = len(ids) // args.seq_len
    if usable < n_chunks:
        raise ValueError(
            f"corpus gives {usable} chunks of {args.seq_len} tokens, {n_chunks} needed"
        )
    chunks = torch.tensor(ids[: usable * args.seq_len]).view(usable, args.seq_len)
    order = torch.randperm(usable, generator=torch.Generator().manual_seed(args.seed))
    return chunks[order[:n_chunks]]


def optimizer_summary(optimizer: torch.optim.Optimizer, accelerator: Accelerator) -> dict:
    """Bytes held by the optimizer states (all ranks) and how many of them are FP8."""
    nbytes = fp8 = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                local = value.to_local() if hasattr(value, "to_local") else value
                nbytes += local.numel() * local.element_size()
                fp8 += local.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    totals = accelerator.reduce(torch.tensor([nbytes, fp8], dtype=torch.float64), "sum")
    return {"bytes": int(totals[0]), "fp8_tensors": int(totals[1])}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="local causal-LM folder (default: tiny Llama)"
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step, all ranks")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=128, help="tiny Llama width")
    parser.add_argument("--layers", type=int, default=4, help="tiny Llama depth")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--optim", choices=["adamw_fp8_coat", "adamw_fp8", "adamw"], default="adamw_fp8_coat"
    )
    parser.add_argument("--eval-batches", type=int, default=2)
    parser.add_argument("--output-dir", default="fsdp2_out", help="checkpoints go here")
    parser.add_argument(
        "--save-every", type=int, default=0, help="save_state every N steps (0: never)"
    )
    parser.add_argument(
        "--resume-from", default=None, help="a checkpoint folder written by this script"
    )
    parser.add_argument("--report", default=None, help="write losses and state sizes as JSON here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    accelerator = make_accelerator()
    set_seed(args.seed)
    model, tokenizer = build_model(args)
    if args.optim == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    else:
        expand = args.optim == "adamw_fp8_coat"
        optimizer = hf_fp8.AdamWFp8(
            model.parameters(), lr=args.lr, weight_decay=0.01, dynamic_range_expansion=expand
        )
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup, args.steps)
    chunks = token_chunks(args, tokenizer, (args.steps + args.eval_batches) * args.global_batch)
    n_train = args.steps * args.global_batch
    train = DataLoader(chunks[:n_train], batch_size=args.global_batch)
    evaluation = DataLoader(chunks[n_train:], batch_size=args.global_batch)
    # FSDP2 needs the model and its optimizer prepared together (it swaps in DTensor params)
    model, optimizer, scheduler, train, evaluation = accelerator.prepare(
        model, optimizer, scheduler, train, evaluation
    )
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if args.resume_from:
        accelerator.load_state(args.resume_from)
        train = accelerator.skip_first_batches(train, progress.step)

    losses: dict[int, float] = {}
    model.train()
    for batch in train:
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        progress.step += 1
        losses[progress.step] = accelerator.reduce(loss.detach(), "mean").item()
        accelerator.print(f"step {progress.step:4d}  loss {losses[progress.step]:.4f}")
        if args.save_every and progress.step % args.save_every == 0:
            accelerator.save_state(str(Path(args.output_dir) / f"step_{progress.step}"))

    model.eval()
    with torch.no_grad():
        eval_losses = [
            accelerator.reduce(model(input_ids=b, labels=b).loss, "mean").item() for b in evaluation
        ]
    result = {
        "world_size": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "optim": args.optim,
        "losses": losses,
        "eval_loss": sum(eval_losses) / max(len(eval_losses), 1),
        "optimizer_state": optimizer_summary(optimizer, accelerator),
        "params": sum(p.numel() for p in model.parameters()),
    }
    if accelerator.is_main_process:
        state = result["optimizer_state"]
        params = result["params"]
        print(f"\n| {result['distributed_type']} × {result['world_size']} | value |\n|---|---|")
        first, last = min(losses, default=0), max(losses, default=0)
        if losses:
            print(
                f"| train loss, step {first} → {last} | {losses[first]:.4f} → {losses[last]:.4f} |"
            )
        print(f"| eval loss | {result['eval_loss']:.4f} |")
        print(f"| optimizer state ({args.optim}) | {state['bytes'] / 2**20:.2f} MiB |")
        if params:
            print(f"| bytes / parameter | {state['bytes'] / params:.2f} (fp32 AdamW: 8) |")
        print(f"| FP8 state tensors | {state['fp8_tensors']} |")
        if args.report:
            Path(args.report).write_text(json.dumps(result, indent=1))
    accelerator.end_training()
    return result


if __name__ == "__main__":
    main()
