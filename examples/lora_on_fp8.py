"""LoRA fine-tuning on an FP8 base vs the same LoRA on the bf16 base (peft + Trainer).

    python examples/lora_on_fp8.py [--steps 80] [--scheme dynamic] [--optim adamw_torch]

1. Pre-trains a small Llama (bytes as tokens) on Python standard-library source and saves
   it in bf16: the "base model".
2. Loads it twice, as bf16 and through ``Fp8Config(scheme)`` (FP8 weights, bf16 compute),
   and trains the same LoRA adapters (same seed, data and steps) on English docstring
   sentences, a domain shift.
3. Prints the eval loss of each before and after LoRA, the FP8 / bf16 gap (target: within
   2 %), and checks that ``merge_and_unload()`` of the FP8 run gives a high-precision model
   with the same outputs.
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from peft import LoraConfig, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)

import hf_fp8
from hf_fp8.utils.corpus import stdlib_sentences, stdlib_source_text
from hf_fp8.utils.minilm import linear_weight_bytes
from hf_fp8.utils.tiny import tiny_llama_config

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def rows(text: str, n: int, seq_len: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``n`` training rows of ``seq_len`` UTF-8 byte ids from ``text``, in a seeded order."""
    data = torch.tensor(list(text.encode("utf-8")))
    chunks = data[: len(data) // seq_len * seq_len].view(-1, seq_len)
    if len(chunks) < n:
        raise ValueError(f"text gives {len(chunks)} chunks of {seq_len} bytes, {n} needed")
    order = torch.randperm(len(chunks), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": c, "labels": c} for c in chunks[order[:n]]]


def trainer_for(model, args: argparse.Namespace, steps: int, lr: float, train: list) -> Trainer:
    """A stock ``Trainer`` with this script's schedule."""
    training_args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="trainer_", dir=args.workdir),
        optim=args.optim,
        max_steps=steps,
        per_device_train_batch_size=args.batch,
        learning_rate=lr,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, steps // 10),
        logging_steps=max(1, steps // 5),
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=args.seed,
    )
    return Trainer(model=model, args=training_args, train_dataset=train)


def pretrain_base(args: argparse.Namespace) -> str:
    """Train the small base model on code and save it in bf16; returns its folder."""
    torch.manual_seed(args.seed)
    config = tiny_llama_config(args.hidden, args.layers, args.seq_len)
    model = LlamaForCausalLM(config)
    code = stdlib_source_text(max_chars=args.base_steps * args.batch * args.seq_len * 4)
    train = rows(code, args.base_steps * args.batch, args.seq_len, args.seed)
    print(f"== pre-training the base model ({args.base_steps} steps on stdlib source)")
    trainer_for(model, args, args.base_steps, args.base_lr, train).train()
    path = os.path.join(args.workdir, "base")
    model.to(torch.bfloat16).save_pretrained(path)
    return path


@torch.no_grad()
def eval_loss(model: torch.nn.Module, evaluation: list, batch: int) -> float:
    """Mean next-byte cross-entropy over the evaluation rows."""
    model.eval()
    ids = torch.stack([row["input_ids"] for row in evaluation])
    losses = [model(input_ids=b, labels=b).loss.item() for b in ids.split(batch)]
    return sum(losses) / len(losses)


def lora_run(base: str, fp8: bool, args: argparse.Namespace, train, evaluation) -> dict:
    """Load the base (bf16 or FP8), evaluate, train LoRA, evaluate again."""
    config = hf_fp8.Fp8Config(args.scheme) if fp8 else None
    model = AutoModelForCausalLM.from_pretrained(
        base, dtype=torch.bfloat16, quantization_config=config
    )
    name = f"FP8 ({args.scheme})" if fp8 else "bf16"
    weights = linear_weight_bytes(model)[0] / 2**20  # FP8: weights + scales
    print(f"\n== LoRA on the {name} base")
    before = eval_loss(model, evaluation, args.batch)
    torch.manual_seed(args.seed)  # identical adapter initialisation for both bases
    model = get_peft_model(
        model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS)
    )
    trainer_for(model, args, args.steps, args.lr, train).train()
    return {
        "name": name,
        "model": model,
        "weights_mib": weights,
        "before": before,
        "after": eval_loss(model, evaluation, args.batch),
    }


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80, help="LoRA steps")
    parser.add_argument("--base-steps", type=int, default=150, help="base pre-training steps")
    parser.add_argument("--scheme", default="dynamic", choices=["dynamic", "weight_only"])
    parser.add_argument("--optim", default="adamw_torch", help="e.g. adamw_torch, adamw_fp8_coat")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--base-lr", type=float, default=2e-3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--eval-sequences", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    # Everything this script writes (trainer folders, the base model) lives in one temporary
    # folder, removed at the end.
    with tempfile.TemporaryDirectory(prefix="lora_on_fp8_") as workdir:
        args.workdir = workdir
        base = pretrain_base(args)
        prose = "\n".join(stdlib_sentences(2000, seed=args.seed))
        data = rows(prose, args.steps * args.batch + args.eval_sequences, args.seq_len, args.seed)
        train, evaluation = data[: -args.eval_sequences], data[-args.eval_sequences :]
        bf16 = lora_run(base, False, args, train, evaluation)
        fp8 = lora_run(base, True, args, train, evaluation)

    # merge_and_unload() of the FP8 run: high-precision layers, same function
    model = fp8["model"].eval()
    batch = torch.stack([row["input_ids"] for row in evaluation[: args.batch]])
    with torch.no_grad():
        expected = model(input_ids=batch).logits.float()
        merged = model.merge_and_unload()
        got = merged(input_ids=batch).logits.float()
    merge_rel = ((got - expected).norm() / expected.norm()).item()
    merged_type = type(merged.model.layers[0].self_attn.q_proj).__name__

    gap = fp8["after"] / bf16["after"] - 1
    print(
        f"\nLoRA r={args.rank} on {len(TARGETS)} projections, {args.steps} steps, optim={args.optim}\n"
    )
    print("| base | linear weights MiB | eval loss before LoRA | after LoRA | vs bf16 |")
    print("|---|---|---|---|---|")
    for r in (bf16, fp8):
        vs = f"{100 * (r['after'] / bf16['after'] - 1):+.2f} %"
        print(
            f"| {r['name']} | {r['weights_mib']:.3f} | {r['before']:.4f} | {r['after']:.4f} | {vs} |"
        )
    print(f"\nFP8 vs bf16 eval loss after LoRA: {100 * gap:+.2f} % (target: within 2 %)")
    print(f"merge_and_unload(): q_proj is {merged_type}, outputs within {merge_rel:.1e} (relative)")
    return {
        "bf16_before": bf16["before"],
        "bf16_after": bf16["after"],
        "fp8_before": fp8["before"],
        "fp8_after": fp8["after"],
        "gap": gap,
        "merge_rel": merge_rel,
        "merged_type": merged_type,
    }


if __name__ == "__main__":
    main()
