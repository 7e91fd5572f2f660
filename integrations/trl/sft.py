"""TRL ``SFTTrainer``: LoRA on an FP8 base, trained with ``optim="adamw_fp8_coat"``.

    python integrations/trl/sft.py [--model PATH] [--steps 40] [--optim adamw_fp8_coat]

TRL loads the model itself (``SFTTrainer(model=path, quantization_config=Fp8Config(...))``):
every linear becomes an FP8 ``Fp8Linear`` (frozen), peft adds LoRA adapters (fp32), and the
adapters train with AdamWFp8 (FP8 Adam moments). Without ``--model`` a small random Llama
with the local MiniLM tokenizer stands in for a real base, so it runs offline on a CPU; the
data are English sentences from the Python standard library's docstrings.
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoTokenizer, LlamaForCausalLM
from trl import SFTConfig, SFTTrainer

import hf_fp8
from hf_fp8.utils.corpus import stdlib_sentences
from hf_fp8.utils.minilm import default_model_path
from hf_fp8.utils.tiny import tiny_llama_config


def tiny_base(args: argparse.Namespace) -> str:
    """Save a small random Llama and the MiniLM tokenizer to a folder; returns it."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    tokenizer.eos_token = tokenizer.sep_token  # BERT vocabulary: [SEP] ends a text
    torch.manual_seed(args.seed)
    config = tiny_llama_config(
        args.hidden,
        args.layers,
        args.max_length,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.sep_token_id,
    )
    path = tempfile.mkdtemp(prefix="sft_base_")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def state_summary(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(bytes of the optimizer's state tensors, how many of them are FP8)."""
    tensors = [
        v
        for state in optimizer.state.values()
        for k, v in state.items()
        if isinstance(v, torch.Tensor) and k != "step"
    ]
    fp8 = sum(t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for t in tensors)
    return sum(t.numel() * t.element_size() for t in tensors), fp8


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="local causal-LM folder (default: tiny Llama)"
    )
    parser.add_argument("--scheme", default="dynamic", choices=["dynamic", "weight_only"])
    parser.add_argument(
        "--optim", default="adamw_fp8_coat", help="adamw_fp8_coat, adamw_torch, ..."
    )
    parser.add_argument(
        "--min-quantize-numel",
        type=int,
        default=None,
        help="AdamWFp8 keeps fp32 moments for smaller tensors (default 4096)",
    )
    parser.add_argument(
        "--group-size", type=int, default=None, help="AdamWFp8 group size (default: --rank)"
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=128, help="tiny Llama width")
    parser.add_argument("--layers", type=int, default=2, help="tiny Llama depth")
    parser.add_argument("--eval-examples", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    path = args.model or tiny_base(args)
    sentences = stdlib_sentences(args.steps * args.batch + args.eval_examples, seed=args.seed)
    train = Dataset.from_dict({"text": sentences[: -args.eval_examples]})
    evaluation = Dataset.from_dict({"text": sentences[-args.eval_examples :]})
    optim_args = None
    if args.optim.startswith("adamw_fp8"):
        # AdamWFp8 groups elements within rows; LoRA B is [out, rank], rows much shorter than
        # the group keep fp32 state (8 bytes/param instead of ~3): group by the rank.
        group_size = args.group_size or min(args.rank, 128)
        optim_args = f"group_size={group_size}"
        if args.min_quantize_numel is not None:
            optim_args += f",min_quantize_numel={args.min_quantize_numel}"
    config = SFTConfig(
        output_dir=tempfile.mkdtemp(prefix="sft_out_"),
        model_init_kwargs={"dtype": torch.bfloat16},
        optim=args.optim,
        optim_args=optim_args,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=args.batch,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, args.steps // 10),
        logging_steps=max(1, args.steps // 10),
        max_length=args.max_length,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=args.seed,
    )
    trainer = SFTTrainer(
        model=path,
        args=config,
        train_dataset=train,
        eval_dataset=evaluation,
        quantization_config=hf_fp8.Fp8Config(args.scheme),
        peft_config=LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear"),
    )
    eval_before = trainer.evaluate()["eval_loss"]
    trainer.train()
    eval_after = trainer.evaluate()["eval_loss"]

    model = trainer.model
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate wrapper
    nbytes, fp8 = state_summary(optimizer)
    fp8_layers = sum(isinstance(m, hf_fp8.Fp8Linear) for m in model.modules())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    print(f"\n| SFTTrainer, {args.steps} steps | value |\n|---|---|")
    print(f"| base | {fp8_layers} Fp8Linear layers ({args.scheme}), frozen |")
    print(f"| LoRA | r={args.rank}, {trainable / 1e3:.1f} k trainable parameters |")
    print(f"| optimizer | {args.optim} → {type(optimizer).__name__} ({optim_args or 'defaults'}) |")
    print(
        f"| optimizer state | {nbytes / 2**10:.1f} KiB ({nbytes / trainable:.2f} bytes / "
        f"trainable parameter), {fp8} FP8 tensors |"
    )
    print(f"| train loss | {losses[0]:.3f} → {losses[-1]:.3f} |")
    print(f"| eval loss | {eval_before:.4f} → {eval_after:.4f} |")
    return {
        "trainer": trainer,
        "base": path,
        "optimizer": type(optimizer).__name__,
        "state_bytes": nbytes,
        "fp8_state_tensors": fp8,
        "fp8_layers": fp8_layers,
        "losses": losses,
        "eval_before": eval_before,
        "eval_after": eval_after,
    }


if __name__ == "__main__":
    main()
