"""Model card and Hub upload for DSpark drafters.

Why a card generator: a drafter is useless without knowing which target, which aux layers and which slot convention
it was trained for, and its τ only means something next to how it was measured. The card states all of it, in the
Kimi-K2.6 card's terms (τ out of B, per-position acceptance), with YAML front matter the Hub indexes.

Why `push_drafter_to_hub` is more than `drafter.push_to_hub`: transformers' push uploads the weights, config,
`generation_config.json` and both remote-code files (via `register_for_auto_class`) but writes a generic README;
the generated card follows in a second commit, together with the drafting settings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from huggingface_hub import CommitOperationAdd, HfApi, ModelCard, ModelCardData

CARD_TAGS = ["speculative-decoding", "dspark"]


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, (list, tuple)):
        return " / ".join(_cell(v) for v in value)
    return str(value).replace("|", "\\|")


def markdown_table(rows: Mapping[str, Mapping[str, Any]], first_column: str) -> str:
    """`{row name: {column: value}}` as a Markdown table; columns in first-seen order."""
    columns: list[str] = []
    for row in rows.values():
        columns += [c for c in row if c not in columns]
    lines = [
        "| " + " | ".join([first_column, *columns]) + " |",
        "|" + "---|" * (len(columns) + 1),
    ]
    for name, row in rows.items():
        lines.append("| " + " | ".join([_cell(name), *(_cell(row.get(c, "")) for c in columns)]) + " |")
    return "\n".join(lines)


def build_model_card(
    config,
    *,
    target: str | None = None,
    repo_id: str | None = None,
    training_data: str | Sequence[str] | None = None,
    training_command: str | None = None,
    tau: Mapping[str, Mapping[str, Any]] | None = None,
    speed: Mapping[str, Mapping[str, Any]] | None = None,
    machine: str | None = None,
    description: str | None = None,
    more_sections: Sequence[str] = (),
) -> ModelCard:
    """A model card for a drafter with `config` (a `DSparkConfig`).

    Args:
        target: the target model's Hub id (`base_model`); defaults to the config's verifier.
        training_data, training_command: what the drafter was trained on and the exact command.
        tau: rows of the acceptance table, e.g. `{"gsm8k (offline)": {"τ": 3.97, "acceptance": [0.82, ...]}}`.
        speed: rows of the speed table, e.g. `{"greedy": {"tokens/s": 41.2, "speedup": 2.6}}`.
        machine: where `tau`/`speed` were measured.
        more_sections: Markdown sections appended at the end (e.g. how the drafter's size was chosen).
    """
    target = target or config.verifier_name_or_path
    data = ModelCardData(library_name="transformers", tags=list(CARD_TAGS), base_model=target)
    sections = [
        f"# DSpark drafter for {target or 'its target'}",
        description
        or "A DSpark speculative-decoding drafter: one parallel pass drafts a block from fused target hidden states, "
        "a Markov head corrects it left to right, and a confidence head predicts how far it will be accepted. "
        "Generation with it is lossless: the output is that of the target alone.",
        "## Architecture",
        markdown_table(_architecture_rows(config, target), "Field"),
        *_usage_section(target, repo_id, config.num_draft_tokens),
        *_training_section(training_data, training_command),
        *_measurement_sections(config, tau, speed, machine),
        *more_sections,
    ]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n\n".join(sections) + "\n")


def _architecture_rows(config, target: str | None) -> dict[str, dict[str, Any]]:
    """The rows of the card's architecture table: what a user must match (target, aux layers, slots, vocabulary)."""
    vocab = (
        f"{config.draft_vocab_size} of {config.vocab_size} target tokens (d2t/t2d)"
        if config.draft_vocab_size < config.vocab_size
        else f"full target vocabulary ({config.vocab_size})"
    )
    markov = f"{config.markov_head_type}, rank {config.markov_rank}" if config.markov_rank else "off (DFlash)"
    confidence = (
        ("on, with Markov features" if config.confidence_head_with_markov and config.markov_rank else "on")
        if config.enable_confidence_head
        else "off"
    )
    return {
        "Target": {"value": target or "unspecified"},
        "Draft layers": {"value": f"{config.num_hidden_layers} × Qwen3-style (d = {config.hidden_size}, "
                                  f"{config.num_attention_heads}/{config.num_key_value_heads} heads, FFN {config.intermediate_size})"},
        "Block size": {"value": f"{config.block_size} ({config.num_draft_tokens} drafts per block, sample_from_anchor = "
                                f"{str(config.sample_from_anchor).lower()})"},
        "Aux layers": {"value": f"{list(config.aux_hidden_state_layer_ids)} (HF hidden_states index; "
                                f"target_layer_ids {config.target_layer_ids})"},
        "Mask token id": {"value": config.mask_token_id},
        "Vocabulary": {"value": vocab},
        "Markov head": {"value": markov},
        "Confidence head": {"value": confidence},
    }


def _usage_section(target: str | None, repo_id: str | None, num_draft_tokens: int) -> list[str]:
    """How to generate with the drafter in transformers, and the vLLM speculative config."""
    return [
        "## Usage",
        "```python\n"
        "from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer\n\n"
        f'target = AutoModelForCausalLM.from_pretrained("{target or "TARGET"}", dtype="auto")\n'
        f'tokenizer = AutoTokenizer.from_pretrained("{target or "TARGET"}")\n'
        f'drafter = AutoModel.from_pretrained("{repo_id or "REPO_ID"}", trust_remote_code=True, dtype="auto")\n'
        'inputs = tokenizer("Hello", return_tensors="pt")\n'
        "out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=128)\n"
        "```",
        "vLLM: `--speculative-config '{\"method\": \"dspark\", \"model\": \""
        f"{repo_id or 'REPO_ID'}\", \"num_speculative_tokens\": {num_draft_tokens}}}'`.",
    ]


def _training_section(training_data: str | Sequence[str] | None, training_command: str | None) -> list[str]:
    """The data and the exact command, when given (nothing otherwise)."""
    if not (training_data or training_command):
        return []
    section = ["## Training"]
    if training_data:
        items = [training_data] if isinstance(training_data, str) else list(training_data)
        section.append("Data:\n" + "\n".join(f"- {item}" for item in items))
    if training_command:
        section.append(f"Command:\n\n```bash\n{training_command}\n```")
    return section


def _measurement_sections(config, tau, speed, machine: str | None) -> list[str]:
    """The acceptance and speed tables and where they were measured, each only when given."""
    sections = []
    if tau:
        sections += [
            "## Acceptance",
            f"τ is the mean accepted length per block including the bonus token, out of {config.block_size}; "
            f"acceptance lists P(draft k accepted | drafts before it accepted) for k = 1..{config.num_draft_tokens}.",
            markdown_table(tau, "Setting"),
        ]
    if speed:
        sections += ["## Speed", markdown_table(speed, "Setting")]
    if machine:
        sections += ["## Machine", machine]
    return sections


def push_drafter_to_hub(
    drafter,
    repo_id: str,
    card: ModelCard | str | None = None,
    *,
    private: bool | None = None,
    token: str | bool | None = None,
    commit_message: str | None = None,
    **card_kwargs,
):
    """Upload `drafter` (weights, config, both remote-code files, generation config) and its model card to `repo_id`.

    `card` defaults to `build_model_card(drafter.config, repo_id=repo_id, **card_kwargs)`. Returns the final commit.
    """
    if card is None:
        card = build_model_card(drafter.config, repo_id=repo_id, **card_kwargs)
    elif card_kwargs:
        raise ValueError(f"pass either card= or card fields ({', '.join(card_kwargs)}), not both.")
    card_text = card.content if isinstance(card, ModelCard) else str(card)
    drafter.push_to_hub(repo_id, private=private, token=token, commit_message=commit_message, tags=list(CARD_TAGS))
    operations = [
        CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=card_text.encode()),
        CommitOperationAdd(
            path_in_repo="generation_config.json", path_or_fileobj=drafter.generation_config.to_json_string().encode()
        ),
    ]
    return HfApi().create_commit(
        repo_id=repo_id, operations=operations, commit_message="Add DSpark model card", token=token
    )


__all__ = ["CARD_TAGS", "build_model_card", "markdown_table", "push_drafter_to_hub"]
