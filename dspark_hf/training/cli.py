"""`dspark-hf train`: the command line of `dspark_hf.training.trainer.train`.

Run it directly (one process) or under `accelerate launch` (DDP, FSDP, DeepSpeed, mixed precision) with no change:
  accelerate launch --config_file examples/accelerate/ddp.yaml -m dspark_hf.cli train --train-cache ... --target ...
`--lora` adapts an existing drafter (`--init-from`) with PEFT; `--merge` also writes a plain merged drafter;
`--merge-adapter BASE ADAPTER` merges a finished adapter into a plain checkpoint without training.
`--online --target T --dataset D` trains without a cache: the frozen target runs inside the loop (`online.py`).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields

from ..flags import (OneLineParser, below_one, layer_ids, non_negative_float, non_negative_int, positive_float,
                     positive_int, seed)
from ..progress import add_progress_argument
from ..targets import add_target_argument
from .online import ONLINE_DTYPES, check_data_source
from .trainer import TrainingArguments


def _config_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _overrides(items: list[str]) -> dict:
    overrides = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"--drafter-config {item!r} is not KEY=VALUE; write e.g. --drafter-config num_hidden_layers=2")
        key, value = item.split("=", 1)
        overrides[key.strip()] = _config_value(value)
    return overrides


def _add_initialisation_arguments(parser: argparse.ArgumentParser) -> None:
    init = parser.add_argument_group("initialisation")
    add_target_argument(init)  # its embeddings and LM head are bound into the drafter; --online runs it in the loop
    init.add_argument("--embed-target-copies", action="store_true",
                      help="also store the target's embedding and LM-head rows in the drafter's directory (for runtimes "
                           "that cannot bind them from the target; default: bound at attach time, not stored)")
    init.add_argument("--draft-vocab", help="d2t/t2d file from `dspark-hf vocab` (default: full vocabulary)")
    init.add_argument("--init-from",
                      help="warm start from a DSpark or z-lab DFlash checkpoint directory (heads added if absent; more "
                           "--num-draft-layers or a higher --markov-rank grow it without changing its drafts)")
    init.add_argument("--mask-token-id", type=non_negative_int,
                      help="token filling the block's draft slots (default: from the target tokenizer: its mask token, "
                           "else a reserved/unused special token, else the added special token with the highest id; "
                           "never bos/eos/pad/unk and never a token that occurs in the training cache, such as the "
                           "end-of-turn token)")
    init.add_argument("--num-draft-layers", type=positive_int, help="draft transformer layers (default 1)")
    init.add_argument("--block-size", type=positive_int, help="slots per block, anchor included (default 8)")
    init.add_argument("--sample-from-anchor", action="store_true", default=None, help="DSpark-paper slot convention (B drafts)")
    init.add_argument("--markov-rank", type=non_negative_int, help="rank of the Markov head (0 disables it; default 256)")
    init.add_argument("--markov-head-type", choices=["vanilla", "gated", "rnn"])
    init.add_argument("--no-confidence-head", action="store_true", help="train without the confidence head")
    init.add_argument("--drafter-config", nargs="*", metavar="KEY=VALUE", default=[],
                      help="any other DSparkConfig field, e.g. intermediate_size=1536 (values parsed as JSON)")


def _add_online_arguments(parser: argparse.ArgumentParser, defaults: TrainingArguments) -> None:
    online = parser.add_argument_group(
        "online (cache-free) training",
        "run the frozen --target inside the training loop instead of reading a cache; the dataset is read and tokenized "
        "as `dspark-hf cache` reads it, so the drafter equals one trained on a cache of the same data and dtype")
    online.add_argument("--online", action="store_true", help="train without a cache (needs --target and --dataset)")
    online.add_argument("--dataset", help="JSONL, Parquet, Arrow, a `save_to_disk` folder, a folder of shards, a Hub "
                        "dataset id (OpenAI messages or ShareGPT conversations), or `chitchat` / `chatterbot`")
    online.add_argument("--messages-column", default=None,
                        help="the column holding each conversation's turns (default: messages or conversations)")
    online.add_argument("--split", default=defaults.split, choices=["train", "validation", "test", "all"],
                        help="hash split of --dataset to train on (default: all)")
    online.add_argument("--limit", type=positive_int, help="only the first N conversations of the split")
    online.add_argument("--eval-dataset", help="held-out conversations for periodic validation (online, instead of --eval-cache)")
    online.add_argument("--eval-split", default=defaults.eval_split, choices=["train", "validation", "test", "all"],
                        help="hash split of --eval-dataset (default: all; e.g. `--dataset D --split train --eval-dataset "
                             "D --eval-split validation`)")
    online.add_argument("--max-length", type=positive_int, default=defaults.max_length, help="truncate samples to this many tokens (default: 2048)")
    online.add_argument("--aux-layers", type=layer_ids,
                        help="comma-separated aux layer ids (default as `dspark-hf cache`: 1, (L-3)//2 and L-4)")
    online.add_argument("--target-dtype", default=defaults.target_dtype, choices=list(ONLINE_DTYPES),
                        help="dtype the target runs in (default: float32)")
    online.add_argument("--online-dtype", default=defaults.online_dtype, choices=list(ONLINE_DTYPES),
                        help="the captured hidden states are rounded to this dtype, as a cache stores them in its "
                             "--dtype (default: bfloat16, the cache's default)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = TrainingArguments(output_dir="")
    data = parser.add_argument_group("data")
    data.add_argument("--train-cache", help="hidden-state cache to train on (`dspark-hf cache`); the drafter reads the aux "
                      "layers it was captured with: by default 1, (L-3)//2 and L-4 of an L-layer target (low, middle "
                      "and high, the Kimi-K2.6 DSpark spacing); rebuild the cache with --aux-layers to match a drafter "
                      "you warm-start from or to try other depths")
    data.add_argument("--eval-cache", help="held-out cache for periodic validation")
    data.add_argument("--output-dir", help="where checkpoints, logs and the final drafter go")
    _add_online_arguments(parser, defaults)

    _add_initialisation_arguments(parser)

    lora = parser.add_argument_group("LoRA")
    lora.add_argument("--lora", action="store_true", help="train PEFT LoRA adapters on the draft layers only")
    lora.add_argument("--lora-rank", type=positive_int, default=defaults.lora_rank)
    lora.add_argument("--lora-alpha", type=positive_float, default=defaults.lora_alpha)
    lora.add_argument("--lora-dropout", type=below_one, default=defaults.lora_dropout)
    lora.add_argument("--lora-fc", action="store_true", help="also adapt `fc` (the context fusion)")
    lora.add_argument("--merge", action="store_true", help="after LoRA training also write the merged drafter to OUTPUT/drafter")
    lora.add_argument("--merge-adapter", nargs=2, metavar=("BASE", "ADAPTER"),
                      help="no training: merge ADAPTER into the drafter BASE and write it to --output-dir")

    opt = parser.add_argument_group("optimisation")
    opt.add_argument("--learning-rate", type=positive_float, default=defaults.learning_rate)
    opt.add_argument("--weight-decay", type=non_negative_float, default=defaults.weight_decay)
    opt.add_argument("--warmup-steps", type=non_negative_int, default=defaults.warmup_steps)
    opt.add_argument("--max-steps", type=positive_int, help="optimizer steps (default: --num-epochs over the cache)")
    opt.add_argument("--num-epochs", type=positive_int, default=defaults.num_epochs)
    opt.add_argument("--batch-size", type=positive_int, default=defaults.batch_size, help="samples per process per micro-step")
    opt.add_argument("--gradient-accumulation-steps", type=positive_int, default=defaults.gradient_accumulation_steps)
    opt.add_argument("--max-grad-norm", type=positive_float, default=defaults.max_grad_norm)
    opt.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], help="default: the accelerate config's")
    opt.add_argument("--max-anchors", type=positive_int, default=defaults.max_anchors, help="blocks per sample per step")
    opt.add_argument("--eval-max-anchors", type=positive_int, default=defaults.eval_max_anchors)
    opt.add_argument("--alpha-ce", type=non_negative_float, default=defaults.alpha_ce)
    opt.add_argument("--alpha-tv", type=non_negative_float, default=defaults.alpha_tv)
    opt.add_argument("--alpha-conf", type=non_negative_float, default=defaults.alpha_conf)
    opt.add_argument("--gamma", type=positive_float, default=defaults.gamma, help="position decay of the loss weights")
    opt.add_argument("--seed", type=seed, default=defaults.seed)

    book = parser.add_argument_group("logging and checkpoints")
    book.add_argument("--logging-steps", type=positive_int, default=defaults.logging_steps)
    book.add_argument("--eval-steps", type=non_negative_int, default=defaults.eval_steps, help="0 = validate at the end only")
    book.add_argument("--save-steps", type=non_negative_int, default=defaults.save_steps, help="0 = checkpoint at the end only")
    book.add_argument("--save-total-limit", type=positive_int, default=defaults.save_total_limit,
                      help="keep only the newest N checkpoints, deleting older ones after each save (default: keep all)")
    book.add_argument("--resume", nargs="?", const=True, default=False,
                      help="continue from the latest checkpoint in --output-dir (or the given checkpoint directory)")
    book.add_argument("--max-steps-per-run", type=positive_int, help="checkpoint and stop after this many steps (time-boxed jobs)")
    book.add_argument("--report-to", default=defaults.report_to, help="accelerate tracker (tensorboard, wandb, ...) or 'none'")
    add_progress_argument(book)


def arguments_from_namespace(args: argparse.Namespace) -> TrainingArguments:
    """The parsed command line as `TrainingArguments` (one clear error for each missing required path)."""
    check_data_source(args)
    if not args.output_dir:
        raise ValueError("--output-dir is required for `dspark-hf train`.")
    overrides = _overrides(args.drafter_config)
    for flag, key in (("mask_token_id", "mask_token_id"), ("num_draft_layers", "num_hidden_layers"),
                      ("block_size", "block_size"), ("sample_from_anchor", "sample_from_anchor"),
                      ("markov_rank", "markov_rank"), ("markov_head_type", "markov_head_type")):
        if getattr(args, flag) is not None:
            overrides[key] = getattr(args, flag)
    if args.no_confidence_head:
        overrides["enable_confidence_head"] = False
    names = {f.name for f in fields(TrainingArguments)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values.update(
        drafter_config=overrides,
        merge_lora=args.merge,
        progress=not args.no_progress,
        report_to=None if str(args.report_to).lower() in ("none", "") else args.report_to,
    )
    return TrainingArguments(**values)


def run(args: argparse.Namespace) -> int:
    if args.merge_adapter:
        from .lora import merge_adapter_checkpoint

        if not args.output_dir:
            raise ValueError("--merge-adapter needs --output-dir for the merged drafter.")
        merge_adapter_checkpoint(*args.merge_adapter, args.output_dir)
        print(f"merged drafter written to {args.output_dir}")
        return 0
    from .trainer import train

    result = train(arguments_from_namespace(args))
    summary = {k: v for k, v in result.items() if k != "eval_history"}
    print(json.dumps(summary, indent=2, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry for `python -m dspark_hf.training.cli` (the same as `dspark-hf train`)."""
    parser = OneLineParser(prog="dspark-hf train")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
