"""Write the shipped drafter's model card from what `make drafter` measured (examples/make_drafter.sh, last stage).

    python examples/model_card.py OUT_DSPARK WORK OUT_DFLASH SECONDS STEPS SIZE

Reads OUT_DSPARK/eval.json (offline τ and calibration on the multi-domain validation cache), WORK/eval-dflash.json
(the same-budget DFlash-only baseline) and OUT_DSPARK/bench-*.json (`dspark-hf bench` per domain), and writes
OUT_DSPARK/README.md with `dspark_hf.hub.build_model_card`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dspark_hf import DSparkConfig
from dspark_hf.hub import build_model_card, markdown_table

TRAINING_DATA = [
    "SmolLM2-135M-Instruct's own answers (`dspark-hf regenerate`, bf16) to prompts of four domains, train split only "
    "(hash split by conversation id): chat (chitchat-dataset 0.9.0 first two user turns, greedy; chatterbot-corpus "
    "1.3.3, T = 0.8), instructions (WordNet 3.0 questions and tasks about common nouns, greedy; verbs and adjectives, "
    "T = 0.8), code (Python standard-library functions to explain, greedy; to write from their docstrings, T = 0.8), "
    "long multi-turn chats (chitchat conversations of 6 user turns, T = 0.8)",
    "held out of training entirely: HumanEval (164 function-completion prompts), measured in the bench only",
    "calibrated (STS, log loss) and evaluated offline on the validation split of every training corpus",
]


def offline_row(report: dict) -> dict:
    off = report["offline"]
    return {"τ": round(off["tau"], 3), "τ/B": round(off["tau_over_B"], 3),
            "acceptance": " ".join(f"{a:.3f}" for a in off["acceptance"])}


def speed_rows(benches: list[dict]) -> dict:
    """One row per (domain, dtype, mode): DSpark as shipped against plain generate, in the same run."""
    rows = {}
    for bench in benches:
        for domain, result in bench["domains"].items():
            for mode, methods in result["modes"].items():
                row = methods.get("dspark")
                if row is None:
                    continue
                drafter = bench.get("drafter_dtype", bench["dtype"])
                dtype = bench["dtype"] if drafter == bench["dtype"] else f"{bench['dtype']} (drafter {drafter})"
                rows[f"{domain}, {mode}, {dtype}"] = {
                    "plain tok/s": round(methods["plain"]["tokens_per_s"], 1),
                    "DSpark tok/s": round(row["tokens_per_s"], 1),
                    "× plain": f"{row['speedup_vs_plain']:.2f}",
                    "decode × plain": f"{row['decode_speedup_vs_plain']:.2f}" if "decode_speedup_vs_plain" in row else "-",
                    "τ live": f"{row['mean_accepted_length']:.2f}",
                    "drafts/round": f"{row['mean_drafts_per_round']:.2f}",
                }
    return rows


SAMPLED = {"chatterbot", "wordnet-verbs", "stdlib-write", "chitchat-long"}  # regenerated at T = 0.8 (make_drafter.sh)


def data_section(work: Path) -> list[str]:
    """What the drafter trained on, counted from the regenerated files: conversations and assistant tokens per corpus."""
    from transformers import AutoTokenizer

    from dspark_hf.assets import smollm2_path
    from dspark_hf.data import read_jsonl

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_path()))
    rows, total = {}, 0
    for path in sorted((work / "data").glob("*-train.jsonl")):
        corpus = path.name.removesuffix("-train.jsonl")
        records = list(read_jsonl(path))
        tokens = sum(len(tokenizer(m["content"]).input_ids) for r in records for m in r["messages"] if m["role"] == "assistant")
        rows[corpus] = {"conversations": len(records), "assistant tokens": tokens,
                        "answers": "sampled, T = 0.8" if corpus in SAMPLED else "greedy"}
        total += tokens
    return ["## Training data per corpus", f"{total:,} assistant tokens in all (SmolLM2's own answers).",
            markdown_table(rows, "corpus")] if rows else []


def sizing_section(work: Path) -> list[str]:
    """How the size was chosen: every candidate's measured speed-up per domain (examples/pick_size.py)."""
    path = work / "sizing.json"
    if not path.exists():
        return []
    sizing = json.loads(path.read_text())
    count = f"{sizing['training_conversations']} " if sizing.get("training_conversations") else ""
    return ["## How the size was chosen",
            f"Each candidate (layers, FFN width, Markov rank, block size) trained {sizing['steps']} steps on the same "
            f"{count}training conversations, "
            f"then `dspark-hf bench` measured fixed-length blocks against plain generate on {sizing['split']} prompts "
            f"({sizing['max_new_tokens']} new tokens, {sizing['dtype']}, {sizing['machine']}). The default is the "
            f"highest geometric-mean speed-up over every domain and mode within {sizing.get('max_mb', 25):g} MB: "
            f"**{sizing['chosen']}**.",
            markdown_table(sizing["candidates"], "candidate")]


def training_cycles(run: Path) -> list[dict]:
    """The training cycles behind a run's drafter, oldest first, following each run's `--init-from` back to the one
    that started from scratch (a cycle may have trained on an earlier, smaller cache)."""
    cycles = []
    while run is not None and (run / "training_args.json").is_file():
        args = json.loads((run / "training_args.json").read_text())
        manifest = Path(args.get("train_cache") or "") / "manifest.json"
        cache = json.loads(manifest.read_text()) if manifest.is_file() else {}
        cycles.append({"steps": args["max_steps"], "peak learning rate": args["learning_rate"],
                       "training conversations": cache.get("num_samples", "?"),
                       "tokens (prompt + answer)": f"{cache['num_tokens']:,}" if "num_tokens" in cache else "?",
                       "starts from": "the previous cycle's weights" if args.get("init_from") else "scratch"})
        run = Path(args["init_from"]).parent if args.get("init_from") else None
    return cycles[::-1]


def training_section(work: Path) -> list[str]:
    """Every training cycle of the shipped drafter (the last cycle `make drafter` ran: continue-dspark or train-dspark)."""
    last = next((work / name for name in ("continue-dspark", "train-dspark") if (work / name / "drafter").is_dir()), None)
    cycles = training_cycles(last.resolve()) if last else []
    if not cycles:
        return []
    rows = {f"cycle {i}": cycle for i, cycle in enumerate(cycles, start=1)}
    return ["## Training cycles",
            f"{sum(c['steps'] for c in cycles):,} steps in all, each cycle a cosine schedule; the DFlash-only baseline "
            "ran the same cycles on the same data.", markdown_table(rows, "cycle")]


def main(out: Path, work: Path, dflash: Path, seconds: int, steps: str, size: str = "75") -> None:
    evaluation = json.loads((out / "eval.json").read_text())
    baseline = json.loads((work / "eval-dflash.json").read_text())
    benches = [json.loads(p.read_text()) for p in sorted(out.glob("bench-*.json"))]
    tau = {"offline, multi-domain validation (teacher-forced)": offline_row(evaluation),
           f"DFlash-only baseline ({dflash.name}), same data and budget (offline)": offline_row(baseline)}
    config = DSparkConfig.from_pretrained(out)
    card = build_model_card(
        config, target="HuggingFaceTB/SmolLM2-135M-Instruct", repo_id="examples/smollm2-dspark",
        training_data=TRAINING_DATA,
        training_command=f"SIZE={size} STEPS={steps} make drafter   # examples/make_drafter.sh; the run that finished "
                         f"it took {seconds // 60} min (stages already done are skipped, so a resumed run reports less)",
        tau=tau, speed=speed_rows(benches),
        machine=f"{evaluation['machine']}; speed rows name their dtype; ratios measured side by side in one run",
        more_sections=data_section(work) + training_section(work) + sizing_section(work),
        description=f"The default drafter of dspark-hf: a {config.num_hidden_layers}-layer DSpark drafter for "
                    "SmolLM2-135M-Instruct trained on 2 CPU cores, drafting with the hardware-aware schedule "
                    "(`dspark_schedule: \"hardware\"`: each round verifies the number of drafts that maximises "
                    "expected tokens per second, none when drafting does not pay; under greedy decoding it picks k "
                    "after seeing the whole block's confidences) and prompt-lookup drafts priced by the same schedule "
                    "(`dspark_lookup_ngram_size: 4`). The checkpoint omits the frozen `embed_tokens`/`lm_head` (`bind_target_embeddings`); "
                    "they are copied from the target on the first `generate`. Generation with it is lossless.")
    card.save(out / "README.md")
    print(f"model card -> {out / 'README.md'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:7])
