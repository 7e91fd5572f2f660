"""Full fine-tuning with the stock Trainer and ``optim="adamw_fp8_coat"`` vs fp32 AdamW.

    python examples/finetune_coat.py [--steps 150] [--optims adamw_torch adamw_fp8_coat adamw_fp8]

Trains the same small Llama (random init, bytes as tokens) on Python standard-library source
once per optimizer, with identical data, seed and schedule, and prints the optimizer-state
memory and the losses of each against ``optim="adamw_torch"`` (fp32 AdamW).
``adamw_fp8_coat`` keeps both Adam moments in FP8 with COAT's dynamic range expansion,
``adamw_fp8`` in plain per-group FP8. Only ``import hf_fp8`` is needed for the names.
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import LlamaForCausalLM, Trainer, TrainingArguments

import hf_fp8  # noqa: F401  registers optim="adamw_fp8_coat" / "adamw_fp8"
from hf_fp8.utils.corpus import stdlib_source_text
from hf_fp8.utils.tiny import tiny_llama_config

OPTIMS = ("adamw_torch", "adamw_fp8_coat", "adamw_fp8")


def byte_chunks(n: int, seq_len: int, seed: int) -> torch.Tensor:
    """``[n, seq_len]`` UTF-8 byte ids of stdlib source, in a seeded random order."""
    data = torch.tensor(list(stdlib_source_text(max_chars=n * seq_len * 4).encode("utf-8")))
    chunks = data[: len(data) // seq_len * seq_len].view(-1, seq_len)
    order = torch.randperm(len(chunks), generator=torch.Generator().manual_seed(seed))
    return chunks[order[:n]]


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by the optimizer's state tensors (the per-parameter step counters excluded)."""
    return sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for k, v in state.items()
        if isinstance(v, torch.Tensor) and k != "step"
    )


def train_one(optim: str, args: argparse.Namespace, train: list, evaluation: list) -> dict:
    """Fine-tune a fresh copy of the model with ``optim``; losses and state size."""
    torch.manual_seed(args.seed)
    config = tiny_llama_config(args.hidden, args.layers, args.seq_len)
    model = LlamaForCausalLM(config)
    training_args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix=f"finetune_{optim}_"),
        optim=optim,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=args.batch,
        learning_rate=args.lr,
        weight_decay=0.01,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, args.steps // 10),
        logging_steps=max(1, args.steps // 10),
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=args.seed,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=train, eval_dataset=evaluation)
    print(f"\n== optim={optim!r}")
    trainer.train()
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate wrapper
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    return {
        "optimizer": type(optimizer).__name__,
        "state_bytes": state_bytes(optimizer),
        "params": sum(p.numel() for p in model.parameters()),
        "first_loss": losses[0],
        "train_loss": losses[-1],
        "eval_loss": trainer.evaluate()["eval_loss"],
    }


def main(argv: list[str] | None = None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optims", nargs="+", choices=OPTIMS, default=list(OPTIMS))
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--eval-sequences", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    chunks = byte_chunks(args.steps * args.batch + args.eval_sequences, args.seq_len, args.seed)
    rows = [{"input_ids": c, "labels": c} for c in chunks]
    train, evaluation = rows[: -args.eval_sequences], rows[-args.eval_sequences :]
    results = {optim: train_one(optim, args, train, evaluation) for optim in args.optims}

    ref = results.get("adamw_torch")
    print(
        f"\n{args.steps} steps of {args.batch}×{args.seq_len} tokens, "
        f"{next(iter(results.values()))['params'] / 1e6:.2f} M parameters\n"
    )
    print(
        "| optim | optimizer | state MiB | state bytes / param | weights + grads + state MiB "
        "| train loss (first → last log) | eval loss | eval vs AdamW |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for optim, r in results.items():  # fp32 weights and gradients: 8 bytes / parameter
        vs = f"{100 * (r['eval_loss'] / ref['eval_loss'] - 1):+.2f} %" if ref else "—"
        print(
            f"| {optim} | {r['optimizer']} | {r['state_bytes'] / 2**20:.2f} | "
            f"{r['state_bytes'] / r['params']:.2f} | "
            f"{(8 * r['params'] + r['state_bytes']) / 2**20:.2f} | {r['first_loss']:.3f} → "
            f"{r['train_loss']:.3f} | {r['eval_loss']:.4f} | {vs} |"
        )
    return results


if __name__ == "__main__":
    main()
