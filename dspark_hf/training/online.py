"""Online (cache-free) training data: the frozen target runs inside the training loop instead of `dspark-hf cache`.

`OnlineHiddenStates` stands where a `HiddenStateCache` stands in `train()`: sample i is the dataset's conversation i,
tokenized up front exactly as `dspark-hf cache` tokenizes it (same loader, split, limit, chat template and max_length
truncation), and its hidden states are captured when the DataLoader asks for it, by the cache's own
`capture_hidden_states` (same aux layers, same final post-norm state), rounded to `online_dtype` as the cache rounds
to its `--dtype`. The sampler, `collate_samples`, the anchors (seeded by sample index) and the losses are the cached
path's, untouched, so online training on bf16 states equals training on a bf16 cache of the same data.

Why per sample in `__getitem__` rather than one padded forward per batch in the loop:
  - exactness: a sample captured alone has no padding, so its states do not depend on which batch, process or
    resumed epoch it lands in; they are bit-identical to a cache captured one sample per forward (`dspark-hf cache
    --batch-size 1`; its default padded batches of 8 move fp32 states by ~1e-6, other matmul shapes);
  - nothing in the loop changes: validation, the NaN check, `skip_first_batches` on resume (skipped batches are never
    captured) and DDP sharding (each process captures only its own batches) all work as they do on a cache;
  - no compute spent on pads: a random batch of chat samples of mixed length pads to its longest member, while one
    sample of a few hundred tokens already keeps the target's matmuls busy.
The cost: short samples under-fill a large accelerator (batch 1), and the captured rows travel target device → host →
training device, the same (m+1)·d values per token a cache read moves. The DataLoader must run in the training
process (num_workers = 0): each process holds exactly one copy of the target, on its own device, never wrapped by
`accelerator.prepare` and never given gradients.
"""

from __future__ import annotations

import torch

from ..cache import capture_hidden_states, default_aux_layer_ids
from ..data import load_selected_conversations
from ..tokenization import tokenize_conversations
from ..targets import load_target

ONLINE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class OnlineHiddenStates(torch.utils.data.Dataset):
    """Tokenized samples whose hidden states the frozen `target` computes on demand: `data[i]` has the keys and
    shapes of `HiddenStateCache[i]` (input_ids [T], loss_mask bool [T], aux_hidden_states [T, m·d],
    final_hidden_state [T, d])."""

    def __init__(self, target, samples: list[dict[str, torch.Tensor]], aux_layer_ids: list[int], dtype: str = "bfloat16"):
        if dtype not in ONLINE_DTYPES:
            raise ValueError(f"online hidden-state dtype {dtype!r} is not supported; pass --online-dtype {' or '.join(ONLINE_DTYPES)}")
        text = target.config.get_text_config()
        bad = [i for i in aux_layer_ids if not 0 <= i <= text.num_hidden_layers]
        if bad:
            raise ValueError(
                f"aux layer ids {bad} are outside the target's hidden states [0, {text.num_hidden_layers}] "
                "(speculators convention, 0 = embeddings); pass --aux-layers ids in that range"
            )
        self.target, self.samples = target.eval().requires_grad_(False), samples
        self.aux_hidden_state_layer_ids, self.dtype = list(aux_layer_ids), dtype
        self.hidden_size, self.vocab_size, self.num_hidden_layers = text.hidden_size, text.vocab_size, text.num_hidden_layers

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def num_tokens(self) -> int:
        return sum(len(s["input_ids"]) for s in self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample = self.samples[index]
        [(aux, final)] = capture_hidden_states(self.target, [sample], self.aux_hidden_state_layer_ids, ONLINE_DTYPES[self.dtype])
        return {"input_ids": sample["input_ids"], "loss_mask": sample["loss_mask"].bool(),
                "aux_hidden_states": aux, "final_hidden_state": final}

    def token_ids(self) -> set[int]:
        """Every token id of the dataset (the default mask token must be none of them)."""
        return set(torch.cat([s["input_ids"] for s in self.samples]).unique().tolist())

    def check_target(self, model) -> None:
        """The states come from the target itself: nothing to compare (a cache must match `--target`)."""

    def validate_against(self, config) -> None:
        """Refuse a drafter (a warm start) that expects other aux layers or another target geometry."""
        if list(config.aux_hidden_state_layer_ids) != self.aux_hidden_state_layer_ids:
            ids = ",".join(map(str, config.aux_hidden_state_layer_ids))
            raise ValueError(
                f"online training captures aux layers {self.aux_hidden_state_layer_ids} but the drafter expects "
                f"{list(config.aux_hidden_state_layer_ids)}; pass --aux-layers {ids}"
            )
        for field, own in (("target_hidden_size", self.hidden_size), ("target_num_hidden_layers", self.num_hidden_layers),
                           ("vocab_size", self.vocab_size)):
            expected = getattr(config, field, None)
            if expected is not None and expected != own:
                raise ValueError(
                    f"--target has {field}={own} but the drafter expects {expected}; train the drafter for its own "
                    "target or start from scratch"
                )


def check_data_source(args) -> None:
    """Exactly one source of training data: a cache (`--train-cache`) or the target run online (`--online`)."""
    if args.online:
        if args.train_cache:
            raise ValueError("--online trains without a cache but --train-cache was also given; drop --train-cache "
                             "(cache-free training) or --online (training on the cache)")
        if not (args.target and args.dataset):
            raise ValueError("--online needs --target (the frozen model run inside the training loop) and --dataset "
                             "(the conversations to train on); pass both, or train on a cache with --train-cache")
        if getattr(args, "num_workers", 0):
            raise ValueError("--online captures hidden states in the training process; set num_workers=0")
        if args.eval_dataset and args.eval_cache:
            raise ValueError("--eval-dataset and --eval-cache both give validation data; pass only one")
    elif args.dataset or args.eval_dataset:
        flag = "--dataset" if args.dataset else "--eval-dataset"
        raise ValueError(f"{flag} is read only by online training; add --online, or build a cache with `dspark-hf "
                         f"cache --dataset ...` and pass it as --{'train' if args.dataset else 'eval'}-cache")
    elif not args.train_cache:
        raise ValueError("--train-cache is required for `dspark-hf train` (or --online with --target and --dataset)")


def open_online(args, device, log=print) -> list[OnlineHiddenStates]:
    """The training data and, with `--eval-dataset`, the validation data: each dataset tokenized as `dspark-hf cache`
    tokenizes it, both sharing one target loaded in `--target-dtype` on `device` (the datasets are read first, so a
    bad file is refused before a large target loads)."""
    column = args.messages_column
    sources = [load_selected_conversations(args.dataset, args.split, args.limit, messages_column=column)]  # as `cache`
    if args.eval_dataset:
        sources.append(load_selected_conversations(args.eval_dataset, args.eval_split, messages_column=column))
    target, tokenizer = load_target(args.target, dtype=args.target_dtype, device=device)
    aux = list(args.aux_layers) if args.aux_layers else default_aux_layer_ids(target.config.get_text_config().num_hidden_layers)
    data = [OnlineHiddenStates(target, tokenize_conversations(tokenizer, conversations, max_length=args.max_length,
                                                              progress=args.progress),
                               aux, args.online_dtype) for conversations in sources]
    log(f"online: {' + '.join(f'{len(d)} samples ({d.num_tokens} tokens)' for d in data)}; target in "
        f"{args.target_dtype} on {device}, aux layers {aux} stored as {args.online_dtype}")
    return data


def float32_target(data):
    """The online target when it already runs in float32 (the drafter binds its embedding and head from it instead of
    loading a second copy); None otherwise."""
    target = getattr(data, "target", None) if isinstance(data, OnlineHiddenStates) else None
    return target if target is not None and next(target.parameters()).dtype == torch.float32 else None


__all__ = ["ONLINE_DTYPES", "OnlineHiddenStates", "check_data_source", "float32_target", "open_online"]
