"""Offline DSpark training on a hidden-state cache with Accelerate.

The same function runs, with no code change, in every setting `accelerate launch` can configure
(see `examples/accelerate/`):
  - single CPU or single GPU
  - multi-GPU DDP (`--multi_gpu`), multi-node, and DDP over CPU processes
    (`ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N`, gloo)
  - FSDP and DeepSpeed ZeRO-2 through an accelerate config file
  - mixed precision (`--mixed_precision bf16`)

Shape of the loop (as accelerate's `examples/nlp_example.py`): Accelerator → data → model → optimizer →
`accelerator.prepare` → scheduler → loop with `accelerator.accumulate` / `accelerator.backward`, clipping,
periodic validation reduced across processes, `save_state` checkpoints, `load_state` resume.

Exact resume: the sampler is Accelerate's seedable sampler (the permutation of epoch e depends on (seed, e) only),
anchors are drawn from a stream seeded by (seed, epoch, sample index), and `save_state` stores model, optimizer,
scheduler, RNG states and the trainer's position; `--resume` reloads them and skips the batches of the interrupted
epoch already consumed, so the weights equal those of an uninterrupted run bit for bit.

Output directory layout:
  checkpoints/checkpoint-<step>/   `accelerator.save_state` files + `drafter/` (a loadable HF drafter or adapter);
                                   written under a temporary name and renamed, so a killed run never leaves a
                                   half-written checkpoint that `--resume` would pick up
  drafter/                         the final drafter (`AutoModel.from_pretrained(dir, trust_remote_code=True)`)
  adapter/                         the final LoRA adapter (LoRA runs)
  logs/                            tracker files (TensorBoard by default)
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import ProjectConfiguration, set_seed
from safetensors.torch import load_file
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup

from .. import DSparkConfig, DSparkForDrafting
from ..cache import HiddenStateCache
from .anchors import sample_batch_anchors, slot_mask
from .losses import BlockStatistics, LossConfig, draft_labels, dspark_loss, target_probabilities

CHECKPOINTS = "checkpoints"
DEFAULT_MARKOV_RANK = 256


@dataclass
class TrainingArguments:
    """Everything `dspark-hf train` can set. Paths are plain strings so the dataclass serializes to JSON."""

    output_dir: str
    train_cache: str
    eval_cache: str | None = None
    # Initialisation: from scratch (target + draft vocab) or warm start from a DSpark / z-lab DFlash checkpoint.
    target: str | None = None  # target model directory: embed/head are copied from it (`bind_target`)
    draft_vocab: str | None = None  # d2t/t2d file from `dspark-hf vocab`; None = full vocabulary (or the checkpoint's)
    init_from: str | None = None  # existing drafter directory (warm start; heads added if absent)
    drafter_config: dict[str, Any] = field(default_factory=dict)  # DSparkConfig overrides (layers, block_size, heads...)
    # LoRA adaptation of an existing drafter (only the adapter trains).
    lora: bool = False
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    lora_fc: bool = False
    merge_lora: bool = False
    # Optimisation.
    learning_rate: float = 6e-4
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    warmup_steps: int = 0
    max_steps: int | None = None  # optimizer steps; None = num_epochs over the cache
    num_epochs: int = 1
    batch_size: int = 1  # samples per process per micro-step (right-padded)
    gradient_accumulation_steps: int = 1
    max_grad_norm: float = 1.0
    mixed_precision: str | None = None  # None = whatever `accelerate launch` / its config says
    max_anchors: int = 64  # blocks per sample per step
    eval_max_anchors: int = 256
    alpha_ce: float = 0.1
    alpha_tv: float = 0.9
    alpha_conf: float = 1.0
    gamma: float = 4.0
    seed: int = 0
    # Bookkeeping.
    logging_steps: int = 10
    eval_steps: int = 0  # 0 = validate only at the end
    save_steps: int = 0  # 0 = checkpoint only at the end
    resume: bool | str = False  # True = latest checkpoint in output_dir; or a checkpoint directory
    max_steps_per_run: int | None = None  # stop (after a checkpoint) once this run did this many steps (time-boxed jobs)
    report_to: str | None = "tensorboard"  # any accelerate tracker name, or None
    num_workers: int = 0
    progress: bool = True

    def loss_config(self) -> LossConfig:
        return LossConfig(self.alpha_ce, self.alpha_tv, self.alpha_conf, self.gamma)


class TrainingDivergedError(ValueError):
    """A non-finite loss, gradient or input: training stopped, the last good checkpoint is kept."""


class TrainerState:
    """Where the loop is: saved with `save_state` (registered for checkpointing) and restored by `load_state`."""

    def __init__(self):
        self.step = 0  # optimizer steps done
        self.epoch = 0
        self.batches_in_epoch = 0  # micro-batches of `epoch` already consumed

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "epoch": self.epoch, "batches_in_epoch": self.batches_in_epoch}

    def load_state_dict(self, state: dict[str, int]):
        self.step, self.epoch, self.batches_in_epoch = state["step"], state["epoch"], state["batches_in_epoch"]


# ------------------------------------------------------------------------------------------------------------ data
class IndexedCache(Dataset):
    """The cache with each sample's index attached (anchors are seeded by it)."""

    def __init__(self, cache: HiddenStateCache):
        self.cache = cache

    def __len__(self) -> int:
        return len(self.cache)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {**self.cache[index], "index": torch.tensor(index)}


def collate_samples(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad a list of cached samples into one batch; padding is masked everywhere downstream."""
    lengths = torch.tensor([len(s["input_ids"]) for s in samples])  # (b,)
    b, T = len(samples), int(lengths.max())
    aux_width, d = samples[0]["aux_hidden_states"].shape[-1], samples[0]["final_hidden_state"].shape[-1]
    batch = {
        "input_ids": torch.zeros(b, T, dtype=torch.long),
        "loss_mask": torch.zeros(b, T, dtype=torch.bool),
        "attention_mask": torch.zeros(b, T, dtype=torch.long),
        "aux_hidden_states": torch.zeros(b, T, aux_width, dtype=samples[0]["aux_hidden_states"].dtype),
        "final_hidden_state": torch.zeros(b, T, d, dtype=samples[0]["final_hidden_state"].dtype),
        "lengths": lengths,
        "index": torch.stack([s["index"] for s in samples]),
    }
    for row, s in enumerate(samples):
        n = len(s["input_ids"])
        batch["input_ids"][row, :n] = s["input_ids"]
        batch["loss_mask"][row, :n] = s["loss_mask"]
        batch["attention_mask"][row, :n] = 1
        batch["aux_hidden_states"][row, :n] = s["aux_hidden_states"]
        batch["final_hidden_state"][row, :n] = s["final_hidden_state"]
    return batch


# ----------------------------------------------------------------------------------------------------------- model
def _target_text_config(target) -> Any:
    return target.config.get_text_config()


def drafter_config_from_target(target, aux_layer_ids: list[int], **overrides) -> DSparkConfig:
    """A DSpark config fitted to `target`: its hidden size, attention geometry and vocab; one draft layer by default."""
    text = _target_text_config(target)
    heads = text.num_attention_heads
    mask_token_id = overrides.pop("mask_token_id", None)
    if mask_token_id is None:
        pad, eos = getattr(text, "pad_token_id", None), getattr(text, "eos_token_id", None)
        if pad is None or pad == eos or (isinstance(eos, list) and pad in eos):
            raise ValueError(
                "the target has no dedicated pad token to use as the drafter's mask token; pass "
                "--mask-token-id (an unused or reserved token id of the target tokenizer)."
            )
        mask_token_id = pad
    settings = dict(
        hidden_size=text.hidden_size,
        target_hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
        max_position_embeddings=getattr(text, "max_position_embeddings", 32768),
        vocab_size=text.vocab_size,
        aux_hidden_state_layer_ids=list(aux_layer_ids),
        target_num_hidden_layers=text.num_hidden_layers,
        mask_token_id=mask_token_id,
        block_size=8,
        markov_rank=DEFAULT_MARKOV_RANK,
        enable_confidence_head=True,
        verifier_name_or_path=getattr(target, "name_or_path", None) or target.config.name_or_path,
        verifier_architectures=list(target.config.architectures or []),
    )
    rope = getattr(text, "rope_parameters", None)
    if isinstance(rope, dict) and rope.get("rope_type", "default") == "default" and "rope_theta" in rope:
        settings["rope_parameters"] = {"rope_type": "default", "rope_theta": float(rope["rope_theta"])}
    settings.update(overrides)
    return DSparkConfig(**settings)


def _load_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    files = [f for f in files if not f.name.startswith("adapter_")]
    if not files:
        raise ValueError(f"{directory} holds no safetensors weights; point --init-from at a drafter checkpoint directory.")
    state = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def _config_from_checkpoint(directory: Path, overrides: dict[str, Any]) -> DSparkConfig:
    """DSpark configs load as they are; a z-lab DFlash config (`dflash_config`, Qwen3 fields top-level) is mapped."""
    raw = json.loads((directory / "config.json").read_text())
    if "dflash_config" in raw:  # z-lab DFlash: no heads, no embed/head, target_layer_ids = aux - 1
        dflash = raw["dflash_config"]
        keep = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size", "block_size", "rope_theta")
        settings = {k: raw[k] for k in keep if k in raw}
        if "rope_theta" in settings:
            settings["rope_parameters"] = {"rope_type": "default", "rope_theta": float(settings.pop("rope_theta"))}
        settings.update(mask_token_id=dflash["mask_token_id"], target_layer_ids=dflash["target_layer_ids"],
                        markov_rank=0, enable_confidence_head=False)
        base = DSparkConfig(**settings)
    else:
        base = DSparkConfig.from_pretrained(directory)
    settings = base.to_dict()
    for key in ("transformer_layer_config", "speculators_config", "auto_map", "architectures", "model_type",
                "transformers_version", "_name_or_path", "confidence_temperatures"):
        settings.pop(key, None)
    # Heads added if absent (a DFlash checkpoint, or a DSpark one trained without them).
    if not settings.get("markov_rank"):
        settings["markov_rank"] = DEFAULT_MARKOV_RANK
    settings["enable_confidence_head"] = True
    settings.update(overrides)
    return DSparkConfig(**settings)


def load_target_model(name_or_path: str):
    """The target's embeddings and LM head in fp32, read from its safetensors shards (not the whole model);
    `smollm2` = the offline SmolLM2 target."""
    from ..data import load_target_heads

    return load_target_heads(name_or_path)


def build_drafter(args: TrainingArguments, aux_layer_ids: list[int], log=print) -> DSparkForDrafting:
    """From scratch (embed/head bound from the target, vocab from `load_draft_vocab`) or a warm start."""
    from ..vocab import full_draft_vocab, load_draft_vocab

    overrides = dict(args.drafter_config)
    vocab = load_draft_vocab(args.draft_vocab) if args.draft_vocab else None
    if vocab is not None:
        overrides["draft_vocab_size"] = vocab[0].numel()
    target = load_target_model(args.target) if args.target else None

    if args.init_from:
        source = Path(args.init_from)
        if not (source / "config.json").is_file():
            raise ValueError(f"--init-from {source} is not a checkpoint directory (no config.json); pass a DSpark or DFlash drafter directory.")
        config = _config_from_checkpoint(source, overrides)
        drafter = DSparkForDrafting(config)
        state = _load_state_dict(source)
        if vocab is not None:  # a new draft vocabulary: the old head rows and maps no longer apply
            for key in ("lm_head.weight", "d2t", "t2d", "markov_head.markov_w2.weight"):
                state.pop(key, None)
        own = drafter.state_dict()
        wrong = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in state.items() if k in own and v.shape != own[k].shape]
        if wrong:
            raise ValueError(
                f"--init-from {source}: tensor shapes disagree with the drafter config ({'; '.join(wrong[:3])}); "
                "drop the conflicting --drafter overrides or start from scratch."
            )
        result = drafter.load_state_dict(state, strict=False)
        missing = set(result.missing_keys)
        log(f"warm start from {source}: {len(state) - len(result.unexpected_keys)} tensors loaded, "
            f"{len(missing)} initialised fresh ({', '.join(sorted(missing)[:6])}{'...' if len(missing) > 6 else ''})")
        if vocab is not None:
            drafter.set_draft_vocab(*vocab)
        elif "d2t" not in state and config.draft_vocab_size == config.vocab_size:
            drafter.set_draft_vocab(*full_draft_vocab(config.vocab_size))
        if {"embed_tokens.weight", "lm_head.weight"} & missing or vocab is not None:
            if target is None:
                raise ValueError(
                    f"--init-from {source} has no embedding/LM-head copy for this draft vocabulary; pass --target "
                    "so they can be copied from the target model."
                )
            drafter.bind_target(target)
    else:
        if target is None:
            raise ValueError("training from scratch needs --target (the target model directory) to copy its embeddings and LM head.")
        text = _target_text_config(target)
        d2t, t2d = vocab if vocab is not None else full_draft_vocab(text.vocab_size)
        overrides["draft_vocab_size"] = d2t.numel()
        config = drafter_config_from_target(target, aux_layer_ids, **overrides)
        drafter = DSparkForDrafting(config)
        drafter.set_draft_vocab(d2t, t2d)
        drafter.bind_target(target)
    drafter.embed_tokens.weight.requires_grad_(False)
    drafter.lm_head.weight.requires_grad_(False)
    return drafter


def save_drafter(model, directory: Path):
    """A loadable HF directory: the drafter (with its remote code), or the adapter for a PEFT model."""
    model.save_pretrained(directory)


# ---------------------------------------------------------------------------------------------------- train step
def compute_batch_loss(model, batch, head_weight, t2d, loss_config, num_drafts, max_anchors, seed, epoch):
    """One forward over the batch's sampled blocks and the DSpark loss (see `losses.py`)."""
    anchors, anchor_mask = sample_batch_anchors(
        batch["loss_mask"], batch["lengths"], batch["index"], num_drafts, max_anchors, seed, epoch
    )  # (b, J) each
    outputs = model(
        aux_hidden_states=batch["aux_hidden_states"],
        input_ids=batch["input_ids"],
        anchor_positions=anchors,
        attention_mask=batch["attention_mask"],
    )
    target_probs = target_probabilities(batch["final_hidden_state"], outputs.label_positions, head_weight)  # (b, J, N, V_d)
    labels, in_vocab = draft_labels(batch["input_ids"], outputs.label_positions, t2d)
    mask = slot_mask(batch["loss_mask"], anchors, anchor_mask, num_drafts)  # (b, J, N)
    result = dspark_loss(outputs.logits, outputs.confidence_logits, target_probs, labels, in_vocab, mask, loss_config)
    return result, anchor_mask


def _bad_input(batch) -> bool:
    return not (torch.isfinite(batch["aux_hidden_states"]).all() and torch.isfinite(batch["final_hidden_state"]).all())


@torch.no_grad()
def evaluate(accelerator, model, loader, head_weight, t2d, args: TrainingArguments, num_drafts: int) -> dict[str, float]:
    """Validation metrics on the held-out cache with fixed anchors, summed over processes."""
    model.eval()
    stats = BlockStatistics(num_drafts, accelerator.device)
    loss_sums = torch.zeros(4, dtype=torch.float64, device=accelerator.device)  # loss, tv, bce, batches
    for batch in loader:
        result, anchor_mask = compute_batch_loss(
            model, batch, head_weight, t2d, args.loss_config(), num_drafts, args.eval_max_anchors, args.seed, epoch=-1
        )
        stats.update(result, anchor_mask)
        loss_sums += torch.stack([result.loss.detach().double(), result.tv.double(), result.bce.double(),
                                  torch.ones((), dtype=torch.float64, device=loss_sums.device)])
    model.train()
    sums = accelerator.reduce(stats.sums, reduction="sum")
    loss_sums = accelerator.reduce(loss_sums, reduction="sum")
    metrics = stats.compute(sums)
    count = max(float(loss_sums[3]), 1.0)
    metrics.update(loss=float(loss_sums[0]) / count, tv=float(loss_sums[1]) / count, bce=float(loss_sums[2]) / count)
    return metrics


# ---------------------------------------------------------------------------------------------------- checkpoints
def checkpoint_step(path: Path) -> int:
    match = re.fullmatch(r"checkpoint-(\d+)", path.name)
    return int(match.group(1)) if match else -1


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint (temporary, half-written ones are never named checkpoint-<n>)."""
    root = Path(output_dir) / CHECKPOINTS
    found = [p for p in root.glob("checkpoint-*") if p.is_dir() and checkpoint_step(p) >= 0] if root.is_dir() else []
    return max(found, key=checkpoint_step) if found else None


def save_checkpoint(accelerator, model, state: TrainerState, output_dir: Path, metrics: dict | None = None) -> Path:
    root = output_dir / CHECKPOINTS
    final = root / f"checkpoint-{state.step}"
    staging = root / f".checkpoint-{state.step}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(staging))
    if accelerator.is_main_process:
        save_drafter(accelerator.unwrap_model(model), staging / "drafter")
        (staging / "trainer_state.json").write_text(json.dumps({**state.state_dict(), "metrics": metrics or {}}, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
    accelerator.wait_for_everyone()
    return final


# ----------------------------------------------------------------------------------------------------------- train
def train(args: TrainingArguments) -> dict[str, Any]:
    """Train a DSpark drafter on `args.train_cache`; returns the final validation metrics and output paths."""
    output_dir = Path(args.output_dir)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        log_with=args.report_to,
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / "logs")),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        step_scheduler_with_optimizer=False,  # the schedule counts optimizer steps, whatever the world size
    )
    set_seed(args.seed)

    # Data.
    train_cache = HiddenStateCache(args.train_cache)
    eval_cache = HiddenStateCache(args.eval_cache) if args.eval_cache else None
    # Model (built identically on every process; `prepare` wraps it).
    with accelerator.main_process_first():
        model = build_drafter(args, train_cache.aux_hidden_state_layer_ids, log=accelerator.print)
    config = model.config
    for cache in (train_cache, eval_cache):
        if cache is not None:
            cache.validate_against(config)
    num_drafts = config.num_draft_tokens
    # Targets come from the frozen LM head; a plain copy keeps them exact under FSDP/DeepSpeed sharding.
    head_weight = model.lm_head.weight.detach().clone().to(accelerator.device)  # (V_d, d)
    t2d = model.t2d.detach().clone().to(accelerator.device)  # (V_t,)
    if args.lora:
        from .lora import apply_lora

        model = apply_lora(model, args.lora_rank, args.lora_alpha, args.lora_dropout, args.lora_fc)

    train_loader = DataLoader(
        IndexedCache(train_cache), batch_size=args.batch_size, shuffle=True, collate_fn=collate_samples,
        num_workers=args.num_workers, generator=torch.Generator().manual_seed(args.seed),
    )
    eval_loader = (
        DataLoader(IndexedCache(eval_cache), batch_size=args.batch_size, shuffle=False, collate_fn=collate_samples)
        if eval_cache is not None else None
    )

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trainable, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), weight_decay=args.weight_decay
    )
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    if eval_loader is not None:  # sharded across processes; with DDP the last batch may repeat a few samples
        eval_loader = accelerator.prepare(eval_loader)

    steps_per_epoch = max(1, math.ceil(len(train_loader) / args.gradient_accumulation_steps))
    max_steps = args.max_steps or steps_per_epoch * args.num_epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=args.warmup_steps, num_training_steps=max_steps)
    scheduler = accelerator.prepare(scheduler)
    state = TrainerState()
    accelerator.register_for_checkpointing(state)

    if args.resume:
        resume_from = latest_checkpoint(output_dir) if args.resume is True else Path(args.resume)
        if resume_from is None or not resume_from.is_dir():
            raise ValueError(f"--resume: no checkpoint found under {output_dir / CHECKPOINTS}; run without --resume to start fresh.")
        accelerator.load_state(str(resume_from))
        accelerator.print(f"resumed from {resume_from} at step {state.step} (epoch {state.epoch}, batch {state.batches_in_epoch})")

    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "training_args.json").write_text(json.dumps(asdict(args), indent=2, default=str))
    if args.report_to:
        hparams = {k: v for k, v in asdict(args).items() if isinstance(v, (int, float, str, bool))}
        accelerator.init_trackers("dspark", config=hparams)

    accelerator.print(
        f"training {sum(p.numel() for p in trainable):,} parameters for {max_steps} steps "
        f"({accelerator.num_processes} process(es), {len(train_cache)} samples, {num_drafts} drafts per block)"
    )
    progress = tqdm(total=max_steps, initial=state.step, desc="train", disable=not (args.progress and accelerator.is_local_main_process))
    last_checkpoint = latest_checkpoint(output_dir)
    window = BlockStatistics(num_drafts, accelerator.device)
    window_loss = torch.zeros(5, dtype=torch.float64, device=accelerator.device)  # loss, ce, tv, bce, micro-batches
    window_tokens, window_start = torch.zeros((), dtype=torch.float64, device=accelerator.device), time.perf_counter()
    eval_metrics: dict[str, float] = {}
    history: list[tuple[int, dict[str, float]]] = []  # (step, validation metrics)

    def validate():
        metrics = evaluate(accelerator, model, eval_loader, head_weight, t2d, args, num_drafts)
        accelerator.log({f"eval/{k}": v for k, v in metrics.items()}, step=state.step)
        accelerator.print(f"step {state.step}: eval tau={metrics['tau']:.4f} loss={metrics['loss']:.4f}")
        history.append((state.step, metrics))
        return metrics

    if eval_loader is not None and args.eval_steps and state.step == 0:
        validate()  # the untrained baseline
    run_steps = 0
    model.train()

    def diverged(reason: str):
        where = f"the last good checkpoint is {last_checkpoint}" if last_checkpoint else "no checkpoint had been written yet"
        accelerator.end_training()
        raise TrainingDivergedError(
            f"{reason} at step {state.step + 1}; training stopped and {where}. Lower --learning-rate (or check the "
            "cache with `HiddenStateCache(path, verify=True)`) and continue with --resume."
        )

    done = state.step >= max_steps
    while not done:
        train_loader.set_epoch(state.epoch)
        loader = accelerator.skip_first_batches(train_loader, state.batches_in_epoch) if state.batches_in_epoch else train_loader
        for batch in loader:
            state.batches_in_epoch += 1
            with accelerator.accumulate(model):
                result, anchor_mask = compute_batch_loss(
                    model, batch, head_weight, t2d, args.loss_config(), num_drafts, args.max_anchors, args.seed, state.epoch
                )
                # Every process must agree to stop, or the others would hang in the next all-reduce.
                flags = torch.tensor([float(_bad_input(batch)), float(not torch.isfinite(result.loss))], device=accelerator.device)
                flags = accelerator.reduce(flags, reduction="sum")
                if flags[0] > 0:
                    diverged(f"non-finite (NaN/inf) hidden states in cache samples {batch['index'].tolist()}")
                if flags[1] > 0:
                    diverged(f"the loss became non-finite (ce={float(result.ce):.4g}, tv={float(result.tv):.4g}, bce={float(result.bce):.4g})")
                accelerator.backward(result.loss)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)  # post-prepare params (FSDP)
                    if grad_norm is not None and not torch.isfinite(torch.as_tensor(grad_norm)):
                        diverged("the gradient norm became non-finite")
                optimizer.step()
                if accelerator.sync_gradients:
                    scheduler.step()
                optimizer.zero_grad()

            window.update(result, anchor_mask)
            window_loss += torch.stack([result.loss.detach().double(), result.ce.double(), result.tv.double(),
                                        result.bce.double(), torch.ones((), dtype=torch.float64, device=window_loss.device)])
            window_tokens += batch["lengths"].sum()
            if not accelerator.sync_gradients:
                continue

            state.step += 1
            run_steps += 1
            progress.update(1)
            if state.step % args.logging_steps == 0 or state.step == max_steps:
                sums = accelerator.reduce(window.sums, reduction="sum")
                losses = accelerator.reduce(window_loss, reduction="sum")
                tokens = accelerator.reduce(window_tokens, reduction="sum")
                count = max(float(losses[4]), 1.0)
                metrics = {f"train/{k}": v for k, v in window.compute(sums).items()}
                metrics.update({
                    "train/loss": float(losses[0]) / count, "train/ce_term": float(losses[1]) / count,
                    "train/tv": float(losses[2]) / count, "train/bce": float(losses[3]) / count,
                    "train/lr": scheduler.get_last_lr()[0],
                    "train/tokens_per_s": float(tokens) / max(time.perf_counter() - window_start, 1e-9),
                    "train/epoch": state.epoch,
                })
                accelerator.log(metrics, step=state.step)
                progress.set_postfix(loss=f"{metrics['train/loss']:.4f}", tau=f"{metrics['train/tau']:.3f}")
                window = BlockStatistics(num_drafts, accelerator.device)
                window_loss.zero_()
                window_tokens.zero_()
                window_start = time.perf_counter()
            if eval_loader is not None and args.eval_steps and state.step % args.eval_steps == 0 and state.step < max_steps:
                eval_metrics = validate()
            stop_now = args.max_steps_per_run is not None and run_steps >= args.max_steps_per_run
            if state.step < max_steps and ((args.save_steps and state.step % args.save_steps == 0) or stop_now):
                last_checkpoint = save_checkpoint(accelerator, model, state, output_dir)
            if state.step >= max_steps or stop_now:
                done = True
                break
        else:  # epoch finished
            state.epoch += 1
            state.batches_in_epoch = 0
    progress.close()

    finished = state.step >= max_steps
    result: dict[str, Any] = {"step": state.step, "finished": finished, "output_dir": str(output_dir)}
    if finished:
        if eval_loader is not None:
            eval_metrics = validate()
        result["checkpoint"] = str(save_checkpoint(accelerator, model, state, output_dir, eval_metrics))
        if accelerator.is_main_process:
            unwrapped = accelerator.unwrap_model(model)
            if args.lora:
                from .lora import merge_adapter

                save_drafter(unwrapped, output_dir / "adapter")
                result["adapter"] = str(output_dir / "adapter")
                if args.merge_lora:
                    merge_adapter(unwrapped).save_pretrained(output_dir / "drafter")
                    result["drafter"] = str(output_dir / "drafter")
            else:
                save_drafter(unwrapped, output_dir / "drafter")
                result["drafter"] = str(output_dir / "drafter")
        accelerator.wait_for_everyone()
    result["eval"] = eval_metrics
    result["eval_history"] = history
    accelerator.end_training()
    return result


__all__ = [
    "TrainerState",
    "TrainingArguments",
    "TrainingDivergedError",
    "build_drafter",
    "collate_samples",
    "compute_batch_loss",
    "drafter_config_from_target",
    "evaluate",
    "latest_checkpoint",
    "train",
]
