"""DSpark training with Accelerate, on a hidden-state cache or online (cache-free: the frozen target runs inside the
loop on a dataset, `online.py`; the same sampler, anchors and losses, so both give the same drafter).

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
  finished.json                    the settings and summary of a finished run: rerunning it does nothing (`finished`)
  logs/                            tracker files (TensorBoard by default)
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import ProjectConfiguration, set_seed
from filelock import FileLock, Timeout
from torch.utils.data import DataLoader
from transformers import get_cosine_schedule_with_warmup

from ..cache import HiddenStateCache, IndexedCache, collate_samples
from ..progress import progress
from ..targets import load_target_heads
from .anchors import sample_batch_anchors, slot_mask
from .build import build_drafter
from ..files import write_json_atomic
from .finished import finished_summary, record_finished
from .losses import LossConfig, MetricWindow, draft_labels, dspark_loss, target_probabilities
from .online import OnlineHiddenStates, check_data_source, float32_target, open_online

CHECKPOINTS = "checkpoints"


@dataclass
class TrainingArguments:
    """Everything `dspark-hf train` can set. Paths are plain strings so the dataclass serializes to JSON."""

    output_dir: str
    train_cache: str | None = None  # hidden-state cache (`dspark-hf cache`); or `online` below
    eval_cache: str | None = None
    # Online (cache-free) training: the frozen `target` runs inside the loop on `dataset` (see `online.py`).
    online: bool = False
    dataset: str | None = None  # any `--dataset` source, read and tokenized as `dspark-hf cache` reads it
    messages_column: str | None = None  # the column holding the turns (default: messages or conversations)
    split: str = "all"
    limit: int | None = None
    max_length: int | None = 2048
    aux_layers: list[int] | None = None  # None = the cache's default (low, middle, high)
    target_dtype: str = "float32"  # dtype the target runs in
    online_dtype: str = "bfloat16"  # the captured states are rounded to it, as a cache stores them in its --dtype
    eval_dataset: str | None = None  # online validation data (instead of eval_cache)
    eval_split: str = "all"
    # Initialisation: from scratch (target + draft vocab) or warm start from a DSpark / z-lab DFlash checkpoint.
    target: str | None = None  # target model directory: embed/head are bound from it (`bind_target`)
    draft_vocab: str | None = None  # d2t/t2d file from `dspark-hf vocab`; None = full vocabulary (or the checkpoint's)
    init_from: str | None = None  # existing drafter directory (warm start; heads added if absent)
    embed_target_copies: bool = False  # also store the target's embedding and head rows in the drafter's directory
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
    save_total_limit: int | None = None  # keep only the newest N checkpoints; None = all (transformers' Trainer default)
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
    target = target_probabilities(batch["final_hidden_state"], outputs.label_positions, head_weight)
    labels, in_vocab = draft_labels(batch["input_ids"], outputs.label_positions, t2d)
    mask = slot_mask(batch["loss_mask"], anchors, anchor_mask, num_drafts)  # (b, J, N)
    result = dspark_loss(outputs.logits, outputs.confidence_logits, target, labels, in_vocab, mask, loss_config)
    return result, anchor_mask


def _bad_input(batch) -> bool:
    return not (torch.isfinite(batch["aux_hidden_states"]).all() and torch.isfinite(batch["final_hidden_state"]).all())


@torch.no_grad()
def evaluate(accelerator, model, loader, head_weight, t2d, args: TrainingArguments, num_drafts: int) -> dict[str, float]:
    """Validation metrics on the held-out cache with fixed anchors, summed over processes."""
    model.eval()
    window = MetricWindow(num_drafts, accelerator.device)
    batches = progress(loader, total=len(loader), desc="validate", unit="batch", enabled=args.progress,
                       silent=not accelerator.is_local_main_process)
    for batch in batches:
        result, anchor_mask = compute_batch_loss(
            model, batch, head_weight, t2d, args.loss_config(), num_drafts, args.eval_max_anchors, args.seed, epoch=-1
        )
        window.update(result, anchor_mask, batch["lengths"].sum())
    model.train()
    return window.compute(lambda sums: accelerator.reduce(sums, reduction="sum"))


# ---------------------------------------------------------------------------------------------------- checkpoints
def checkpoint_step(path: Path) -> int:
    match = re.fullmatch(r"checkpoint-(\d+)", path.name)
    return int(match.group(1)) if match else -1


def complete_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """The complete checkpoints, oldest first (temporary, half-written ones are never named checkpoint-<n>)."""
    root = Path(output_dir) / CHECKPOINTS
    found = [p for p in root.glob("checkpoint-*") if p.is_dir() and checkpoint_step(p) >= 0] if root.is_dir() else []
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    found = complete_checkpoints(output_dir)
    return found[-1] if found else None


def save_checkpoint(accelerator, model, state: TrainerState, output_dir: Path, args: TrainingArguments,
                    metrics: dict | None = None) -> Path:
    """`save_state` plus a loadable drafter, under a temporary name renamed when complete. `training_args.json` is
    written with the first checkpoint, so a run that fails before it ever saved anything leaves no trace of itself."""
    root = output_dir / CHECKPOINTS
    final = root / f"checkpoint-{state.step}"
    staging = root / f".checkpoint-{state.step}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(staging))
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(staging / "drafter")
        (staging / "trainer_state.json").write_text(json.dumps({**state.state_dict(), "metrics": metrics or {}}, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        write_json_atomic(output_dir / "training_args.json", asdict(args))
        prune_checkpoints(output_dir, args.save_total_limit)
    accelerator.wait_for_everyone()
    return final


def prune_checkpoints(output_dir: Path, keep: int | None) -> None:
    """Delete all but the newest `keep` checkpoints (`--save-total-limit`), once a newer one is complete: a run that
    saves every 100 steps otherwise fills the disk (330 MB per checkpoint for the shipped SmolLM2 drafter)."""
    if keep is None:
        return
    complete = complete_checkpoints(output_dir)
    for old in complete[: max(len(complete) - keep, 0)]:
        shutil.rmtree(old)


def claim_output_dir(accelerator, output_dir: Path) -> FileLock | None:
    """One `train` per output directory: a second one would interleave checkpoints with the first (and crash it).
    The main process holds an OS file lock for the whole run; the OS drops it when the process dies, so a killed
    run never blocks the next."""
    if not accelerator.is_main_process:
        return None
    output_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(output_dir / ".train.lock"), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise ValueError(
            f"another `dspark-hf train` is writing to {output_dir}; wait for it to finish or pick another --output-dir."
        ) from None
    return lock


@contextlib.contextmanager
def removed_if_setup_fails(accelerator, new_output_dir: Path | None, lock: FileLock | None):
    """A run that fails before its first step (a bad cache, a drafter that does not fit, a bad value from Python)
    leaves no output directory behind when it made a new one: nothing in it could be resumed."""
    try:
        yield
    except BaseException:
        if new_output_dir is not None and accelerator.is_main_process:
            if lock is not None:
                lock.release()
            shutil.rmtree(new_output_dir, ignore_errors=True)
        raise


# ----------------------------------------------------------------------------------------------------------- setup
def make_accelerator(args: TrainingArguments, output_dir: Path) -> Accelerator:
    return Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        log_with=args.report_to,
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / "logs")),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        step_scheduler_with_optimizer=False,  # the schedule counts optimizer steps, whatever the world size
    )


def open_caches(accelerator, args: TrainingArguments) -> list[HiddenStateCache | OnlineHiddenStates]:
    """The training data and, when given, the validation cache. A cache has each shard checked against the sha256 in
    its manifest once, before anything reads it: a flipped byte is refused here, naming the shard and the fix.
    Online, training (and `--eval-dataset` validation) data are datasets tokenized up front, their states captured
    on demand (`online.py`)."""
    if args.online:
        with accelerator.main_process_first():  # the main process fetches the target first, the others read it then
            data = open_online(args, accelerator.device, log=accelerator.print)
    else:
        data = [HiddenStateCache(args.train_cache, verify=True)]
    return data + ([HiddenStateCache(args.eval_cache, verify=True)] if args.eval_cache else [])


def make_model(accelerator, args: TrainingArguments, caches: list):
    """(drafter to train, frozen LM-head rows (V_d, d), t2d (V_t,)): the drafter checked against every cache, with
    LoRA adapters when asked. The loss reads plain copies of the head and t2d, exact under FSDP/DeepSpeed sharding.
    Embedding and head are bound from a float32 target: the online one when it runs in float32, else a fresh load."""
    with accelerator.main_process_first():
        target = float32_target(caches[0]) or (load_target_heads(args.target) if args.target else None)
        for cache in caches if target is not None else []:
            cache.check_target(target)
        model = build_drafter(args, caches[0].aux_hidden_state_layer_ids, log=accelerator.print, target=target,
                              cache=caches[0])
    for cache in caches:
        cache.validate_against(model.config)
    head_weight = model.lm_head.weight.detach().clone().to(accelerator.device)  # (V_d, d)
    t2d = model.t2d.detach().clone().to(accelerator.device)  # (V_t,)
    if args.lora:
        from .lora import apply_lora  # peft: only LoRA runs need it

        model = apply_lora(model, args.lora_rank, args.lora_alpha, args.lora_dropout, args.lora_fc)
    return model, head_weight, t2d


def make_loaders(args: TrainingArguments, train_cache, eval_cache) -> tuple[DataLoader, DataLoader | None]:
    """The same seeded sampler and collate for a cache and for online data, so anchors and batches are the same."""
    train_loader = DataLoader(
        IndexedCache(train_cache), batch_size=args.batch_size, shuffle=True, collate_fn=collate_samples,
        num_workers=args.num_workers, generator=torch.Generator().manual_seed(args.seed),
    )
    eval_loader = (
        DataLoader(IndexedCache(eval_cache), batch_size=args.batch_size, shuffle=False, collate_fn=collate_samples)
        if eval_cache is not None else None
    )
    return train_loader, eval_loader


def resume(accelerator, args: TrainingArguments, state: TrainerState) -> None:
    """Reload model, optimizer, scheduler, RNG states and the loop position from a checkpoint (`--resume`)."""
    resume_from = latest_checkpoint(args.output_dir) if args.resume is True else Path(args.resume)
    if resume_from is None or not resume_from.is_dir():
        raise ValueError(f"--resume: no checkpoint found under {Path(args.output_dir) / CHECKPOINTS}; run without --resume to start fresh.")
    accelerator.load_state(str(resume_from))
    accelerator.print(f"resumed from {resume_from} at step {state.step} (epoch {state.epoch}, batch {state.batches_in_epoch})")


def start_trackers(accelerator, args: TrainingArguments) -> None:
    if args.report_to:
        hparams = {k: v for k, v in asdict(args).items() if isinstance(v, (int, float, str, bool))}
        accelerator.init_trackers("dspark", config=hparams)


# ------------------------------------------------------------------------------------------------------------ loop
class TrainingLoop:
    """The moving parts of one run and their bookkeeping: a micro-step, the log window, validation, checkpoints."""

    def __init__(self, accelerator, args: TrainingArguments, model, optimizer, scheduler, eval_loader,
                 head_weight, t2d, state: TrainerState, max_steps: int):
        self.accelerator, self.args, self.model = accelerator, args, model
        self.optimizer, self.scheduler, self.eval_loader = optimizer, scheduler, eval_loader
        self.head_weight, self.t2d, self.state, self.max_steps = head_weight, t2d, state, max_steps
        self.num_drafts = accelerator.unwrap_model(model).config.num_draft_tokens
        self.output_dir = Path(args.output_dir)
        self.window = MetricWindow(self.num_drafts, accelerator.device)
        self.last_checkpoint = latest_checkpoint(self.output_dir)
        self.eval_metrics: dict[str, float] = {}
        self.history: list[tuple[int, dict[str, float]]] = []  # (step, validation metrics)
        self.run_steps = 0
        self.progress = progress(total=max_steps, initial=state.step, desc="train", unit="step", enabled=args.progress,
                                 silent=not accelerator.is_local_main_process)

    def micro_step(self, batch) -> bool:
        """Forward, backward and, at an accumulation boundary, the optimizer step; True when a step was taken."""
        accelerator, args = self.accelerator, self.args
        with accelerator.accumulate(self.model):
            result, anchor_mask = compute_batch_loss(self.model, batch, self.head_weight, self.t2d, args.loss_config(),
                                                     self.num_drafts, args.max_anchors, args.seed, self.state.epoch)
            self.stop_if_diverged(batch, result)
            accelerator.backward(result.loss)
            if accelerator.sync_gradients:
                grad_norm = accelerator.clip_grad_norm_(self.model.parameters(), args.max_grad_norm)  # post-prepare params (FSDP)
                if grad_norm is not None and not torch.isfinite(torch.as_tensor(grad_norm)):
                    raise self.diverged("the gradient norm became non-finite")
            self.optimizer.step()
            if accelerator.sync_gradients:
                self.scheduler.step()
            self.optimizer.zero_grad()
        self.window.update(result, anchor_mask, batch["lengths"].sum())
        return accelerator.sync_gradients

    def after_step(self) -> bool:
        """Count the step, then log, validate and checkpoint as scheduled; True when this run stops here."""
        state, args = self.state, self.args
        state.step += 1
        self.run_steps += 1
        self.progress.update(1)
        if state.step % args.logging_steps == 0 or state.step == self.max_steps:
            self.log_window()
        if self.eval_loader is not None and args.eval_steps and state.step % args.eval_steps == 0 and state.step < self.max_steps:
            self.eval_metrics = self.validate()
        stop_now = args.max_steps_per_run is not None and self.run_steps >= args.max_steps_per_run
        if state.step < self.max_steps and ((args.save_steps and state.step % args.save_steps == 0) or stop_now):
            self.checkpoint()
        return state.step >= self.max_steps or stop_now

    def log_window(self) -> None:
        metrics = {f"train/{k}": v for k, v in self.window.compute(self.reduce).items()}
        metrics.update({"train/lr": self.scheduler.get_last_lr()[0], "train/epoch": self.state.epoch})
        self.accelerator.log(metrics, step=self.state.step)
        self.progress.set_postfix(loss=f"{metrics['train/loss']:.4f}", tau=f"{metrics['train/tau']:.3f}")
        if not self.args.progress:  # no bar: the same numbers on the console
            self.accelerator.print(
                f"step {self.state.step}/{self.max_steps}: loss={metrics['train/loss']:.4f} "
                f"(ce={metrics['train/ce_term']:.4f} tv={metrics['train/tv']:.4f} bce={metrics['train/bce']:.4f}) "
                f"tau={metrics['train/tau']:.3f} tokens/s={metrics['train/tokens_per_s']:.0f} lr={metrics['train/lr']:.2e}"
            )
        self.window.reset()

    def validate(self) -> dict[str, float]:
        metrics = evaluate(self.accelerator, self.model, self.eval_loader, self.head_weight, self.t2d, self.args, self.num_drafts)
        self.accelerator.log({f"eval/{k}": v for k, v in metrics.items()}, step=self.state.step)
        self.accelerator.print(f"step {self.state.step}: eval tau={metrics['tau']:.4f} loss={metrics['loss']:.4f}")
        self.history.append((self.state.step, metrics))
        return metrics

    def checkpoint(self, metrics: dict | None = None) -> Path:
        self.last_checkpoint = save_checkpoint(self.accelerator, self.model, self.state, self.output_dir, self.args, metrics)
        return self.last_checkpoint

    def reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor, reduction="sum")

    def stop_if_diverged(self, batch, result) -> None:
        # Every process must agree to stop, or the others would hang in the next all-reduce.
        flags = torch.tensor([float(_bad_input(batch)), float(not torch.isfinite(result.loss))], device=self.accelerator.device)
        flags = self.reduce(flags)
        if flags[0] > 0:
            samples = batch["index"].tolist()
            where = f"training samples {samples}, captured online from the target" if self.args.online else f"cache samples {samples}"
            raise self.diverged(f"non-finite (NaN/inf) hidden states in {where}")
        if flags[1] > 0:
            raise self.diverged(f"the loss became non-finite (ce={float(result.ce):.4g}, tv={float(result.tv):.4g}, bce={float(result.bce):.4g})")

    def diverged(self, reason: str) -> TrainingDivergedError:
        where = f"the last good checkpoint is {self.last_checkpoint}" if self.last_checkpoint else "no checkpoint had been written yet"
        self.accelerator.end_training()
        check = ("run the target in float32 with --target-dtype float32" if self.args.online
                 else "check the cache with `HiddenStateCache(path, verify=True)`")
        return TrainingDivergedError(
            f"{reason} at step {self.state.step + 1}; training stopped and {where}. Lower --learning-rate (or {check}) "
            "and continue with --resume."
        )


def save_final(accelerator, model, args: TrainingArguments) -> dict[str, str]:
    """The final drafter (and the adapter of a LoRA run) as loadable HF directories; returns their paths."""
    output_dir, paths = Path(args.output_dir), {}
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        if args.lora:
            from .lora import merge_adapter  # peft: only LoRA runs need it

            unwrapped.save_pretrained(output_dir / "adapter")
            paths["adapter"] = str(output_dir / "adapter")
            if args.merge_lora:
                merge_adapter(unwrapped).save_pretrained(output_dir / "drafter")
                paths["drafter"] = str(output_dir / "drafter")
        else:
            unwrapped.save_pretrained(output_dir / "drafter")
            paths["drafter"] = str(output_dir / "drafter")
    accelerator.wait_for_everyone()
    return paths


def finish(loop: TrainingLoop) -> dict[str, Any]:
    """Final validation, checkpoint and drafter of a finished schedule; the summary of any run."""
    state = loop.state
    result: dict[str, Any] = {"step": state.step, "finished": state.step >= loop.max_steps, "output_dir": str(loop.output_dir)}
    if result["finished"]:
        if loop.eval_loader is not None:
            loop.eval_metrics = loop.validate()
        result["checkpoint"] = str(loop.checkpoint(loop.eval_metrics))
        result.update(save_final(loop.accelerator, loop.model, loop.args))
    result["eval"] = loop.eval_metrics
    if result["finished"] and loop.accelerator.is_main_process:
        record_finished(loop.args, result)  # last: a run killed before it reruns its final steps
    result["eval_history"] = loop.history
    loop.accelerator.end_training()
    return result


# ----------------------------------------------------------------------------------------------------------- train
def train(args: TrainingArguments) -> dict[str, Any]:
    """Train a DSpark drafter on `args.train_cache` (or online, running the target on `args.dataset`); returns the
    final validation metrics and output paths; a run that finished in `args.output_dir` with these settings is not
    run again (`finished`)."""
    check_data_source(args)
    done = finished_summary(args)
    if done is not None:
        print(f"train: {args.output_dir} finished already with these settings (step {done.get('step')}); nothing to do")
        return {**done, "already_finished": True}
    return _train(args)


def _train(args: TrainingArguments) -> dict[str, Any]:
    new_output_dir = None if Path(args.output_dir).exists() else Path(args.output_dir)
    accelerator = make_accelerator(args, Path(args.output_dir))
    output_lock = claim_output_dir(accelerator, Path(args.output_dir))  # held until train returns
    with removed_if_setup_fails(accelerator, new_output_dir, output_lock):
        set_seed(args.seed)
        # Data: the caches are checked (online: the dataset tokenized, the target loaded) before anything is built.
        train_cache, *eval_caches = caches = open_caches(accelerator, args)
        eval_cache = eval_caches[0] if eval_caches else None
        # Model (built identically on every process; `prepare` wraps it) and the frozen pieces the loss reads.
        model, head_weight, t2d = make_model(accelerator, args, caches)
        num_drafts = accelerator.unwrap_model(model).config.num_draft_tokens
        train_loader, eval_loader = make_loaders(args, train_cache, eval_cache)

        # Optimizer, `prepare`, then the schedule (it counts optimizer steps, whatever the world size).
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

        # Resume: `load_state` restores everything `save_state` wrote, the loop position included.
        state = TrainerState()
        accelerator.register_for_checkpointing(state)
        if args.resume:
            resume(accelerator, args, state)
        start_trackers(accelerator, args)
        accelerator.print(
            f"training {sum(p.numel() for p in trainable):,} parameters for {max_steps} steps "
            f"({accelerator.num_processes} process(es), {len(train_cache)} samples, {num_drafts} drafts per block)"
        )

    loop = TrainingLoop(accelerator, args, model, optimizer, scheduler, eval_loader, head_weight, t2d, state, max_steps)
    if eval_loader is not None and args.eval_steps and state.step == 0:
        loop.validate()  # the untrained baseline
    model.train()
    done = state.step >= max_steps
    while not done:
        train_loader.set_epoch(state.epoch)
        batches = accelerator.skip_first_batches(train_loader, state.batches_in_epoch) if state.batches_in_epoch else train_loader
        for batch in batches:
            state.batches_in_epoch += 1
            if loop.micro_step(batch) and loop.after_step():
                done = True
                break
        else:  # epoch finished
            state.epoch += 1
            state.batches_in_epoch = 0
    loop.progress.close()
    return finish(loop)


__all__ = [
    "TrainerState",
    "TrainingArguments",
    "TrainingDivergedError",
    "TrainingLoop",
    "build_drafter",
    "compute_batch_loss",
    "evaluate",
    "latest_checkpoint",
    "train",
]
