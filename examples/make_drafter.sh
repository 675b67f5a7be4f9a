#!/usr/bin/env bash
# `make drafter`: rebuild the shipped SmolLM2-135M-Instruct DSpark drafter end to end with the package's CLI only.
#
#   regenerate (SmolLM2 answers chitchat + chatterbot prompts; train/validation splits only, never test)
#   -> cache (teacher-forced hidden states) -> vocab (draft vocabulary)
#   -> train DSpark  and  train the DFlash-only baseline (heads off, same budget)
#   -> calibrate (Sequential Temperature Scaling) -> export bf16 -> eval -> model card
#
# Outputs: examples/smollm2-dspark/ (the shipped drafter, embed/lm_head bound from the target at load) and
# examples/smollm2-dflash/ (the same-budget baseline `dspark-hf bench` compares against).
# Intermediate files go to $WORK (default build/smollm2-drafter). Every stage is skipped when its output exists,
# and regenerate/cache/train resume where an interrupted run stopped, so rerunning the script is cheap.
# Sized for 2 CPU cores; set THREADS to use more, STEPS / CHITCHAT_TRAIN to trade quality for time.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
CLI="$PY -m dspark_hf.cli"
WORK=${WORK:-build/smollm2-drafter}
OUT_DSPARK=${OUT_DSPARK:-examples/smollm2-dspark}
OUT_DFLASH=${OUT_DFLASH:-examples/smollm2-dflash}
THREADS=${THREADS:-1}                 # 1 thread per job beats 2 oversubscribed ones on a shared 2-core box
CHITCHAT_TRAIN=${CHITCHAT_TRAIN:-640} # conversations regenerated (2 user turns each)
CHATTERBOT_TRAIN=${CHATTERBOT_TRAIN:-320}
VALIDATION=${VALIDATION:-24}
STEPS=${STEPS:-1000}
AUX=2,15,28                            # speculators convention (HF hidden_states index) of SmolLM2's 30 layers
MASK=16                                # <empty_output>: a special token chat never uses
export OMP_NUM_THREADS=$THREADS HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
START=$(date +%s)
mkdir -p "$WORK/data"
stage() { echo; echo "=== $* ($(( $(date +%s) - START )) s)"; }

stage "1/8 regenerate: SmolLM2 writes the assistant turns (greedy, bf16)"
REGEN="$CLI regenerate --target smollm2 --dtype bfloat16 --temperature 0 --batch-size 16 --max-new-tokens 96"
$REGEN --input chitchat --split train --limit "$CHITCHAT_TRAIN" --max-turns 2 --output "$WORK/data/chitchat-train.jsonl"
$REGEN --input chitchat --split validation --limit "$VALIDATION" --max-turns 2 --output "$WORK/data/chitchat-validation.jsonl"
$REGEN --input chatterbot --split train --limit "$CHATTERBOT_TRAIN" --max-turns 1 --output "$WORK/data/chatterbot-train.jsonl"
cat "$WORK/data/chitchat-train.jsonl" "$WORK/data/chatterbot-train.jsonl" > "$WORK/data/train.jsonl"

stage "2/8 cache: teacher-forced target hidden states (aux layers $AUX, bf16 storage)"
CACHE="$CLI cache --target smollm2 --aux-layers $AUX --split all --max-length 512 --batch-size 8 --target-dtype bfloat16"
$CACHE --dataset "$WORK/data/train.jsonl" --output "$WORK/cache-train"
$CACHE --dataset "$WORK/data/chitchat-validation.jsonl" --output "$WORK/cache-validation"

stage "3/8 vocab: top-8192 assistant tokens"
[ -f "$WORK/draft_vocab.safetensors" ] || $CLI vocab --cache "$WORK/cache-train" --draft-vocab-size 8192 --output "$WORK/draft_vocab.safetensors"

# One budget for both drafters: same data, layers, steps, batch, anchors, learning rate.
TRAIN_COMMON=(--train-cache "$WORK/cache-train" --eval-cache "$WORK/cache-validation" --target smollm2
  --draft-vocab "$WORK/draft_vocab.safetensors" --mask-token-id $MASK --num-draft-layers 1 --block-size 8
  --max-steps "$STEPS" --batch-size 4 --max-anchors 32 --learning-rate 1e-3 --warmup-steps 30
  --mixed-precision no --eval-steps 0 --save-steps 100 --logging-steps 10 --report-to tensorboard --no-progress)
train() {  # $1 = output dir, rest = head options
  local out=$1; shift
  if [ -d "$out/drafter" ]; then echo "$out/drafter exists, skipped"; return; fi
  local resume=()
  [ -d "$out/checkpoints" ] && [ -n "$(ls -A "$out/checkpoints" 2>/dev/null)" ] && resume=(--resume)
  $CLI train "${TRAIN_COMMON[@]}" --output-dir "$out" "${resume[@]}" "$@"
}
stage "4-5/8 train DSpark (1 layer, Markov rank 64 vanilla, confidence head) and the DFlash-only baseline (heads off),
$STEPS steps each, side by side (one core each; logs in $WORK/train-*.log)"
train "$WORK/train-dspark" --markov-rank 64 --markov-head-type vanilla \
  --drafter-config bind_target_embeddings=true intermediate_size=1024 > "$WORK/train-dspark.log" 2>&1 &
dspark_job=$!
train "$WORK/train-dflash" --markov-rank 0 --no-confidence-head \
  --drafter-config bind_target_embeddings=true intermediate_size=1024 > "$WORK/train-dflash.log" 2>&1 &
dflash_job=$!
wait "$dspark_job"  # set -e: a failed training stops the script here
wait "$dflash_job"

stage "6/8 calibrate the confidence head (STS on the validation cache)"
[ -d "$WORK/dspark-calibrated" ] || $CLI calibrate --model "$WORK/train-dspark/drafter" --cache "$WORK/cache-validation" \
  --target smollm2 --output-dir "$WORK/dspark-calibrated" | tee "$WORK/calibration.txt"

stage "7/8 export bf16 drafters (embed_tokens/lm_head omitted, bound from the target at load)"
# (`dspark-hf export` writes the vLLM layout, which includes the frozen copies; the shipped checkpoint must not.)
to_bf16() {  # $1 = source drafter dir, $2 = destination
  [ -f "$2/model.safetensors" ] && return
  $PY -c 'import sys, torch; from dspark_hf import DSparkForDrafting
m = DSparkForDrafting.from_pretrained(sys.argv[1], dtype=torch.bfloat16)  # d2t/t2d stay int64/bool
assert m.config.bind_target_embeddings; m.save_pretrained(sys.argv[2])' "$1" "$2"
}
to_bf16 "$WORK/dspark-calibrated" "$OUT_DSPARK"
to_bf16 "$WORK/train-dflash/drafter" "$OUT_DFLASH"

stage "8/8 eval (offline on the validation cache, online on held-out test prompts) and model card"
EVAL=(--cache "$WORK/cache-validation" --num-prompts 6 --max-new-tokens 64 --dtype bfloat16 --threads "$THREADS")
[ -f "$WORK/eval-dflash.json" ] || $CLI eval --model "$OUT_DFLASH" "${EVAL[@]}" --modes greedy --json "$WORK/eval-dflash.json"
[ -f "$OUT_DSPARK/eval.json" ] || $CLI eval --model "$OUT_DSPARK" "${EVAL[@]}" --plots "$OUT_DSPARK" --json "$OUT_DSPARK/eval.json"
cp "$WORK/eval-dflash.json" "$OUT_DFLASH/eval.json"
$PY - "$OUT_DSPARK" "$WORK" "$OUT_DFLASH" "$(( $(date +%s) - START ))" "$STEPS" <<'EOF'
import json, sys
from pathlib import Path
from dspark_hf import DSparkConfig
from dspark_hf.hub import build_model_card
out, work, dflash, seconds, steps = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
ev, base = json.loads((out / "eval.json").read_text()), json.loads((work / "eval-dflash.json").read_text())
off, boff = ev["offline"], base["offline"]
tau = {
    "offline, chitchat validation (teacher-forced)": {"τ": round(off["tau"], 3), "τ/B": round(off["tau_over_B"], 3),
        "acceptance": " ".join(f"{a:.3f}" for a in off["acceptance"])},
    "DFlash-only baseline, same budget (offline)": {"τ": round(boff["tau"], 3), "τ/B": round(boff["tau_over_B"], 3),
        "acceptance": " ".join(f"{a:.3f}" for a in boff["acceptance"])},
}
speed = {}
for on in ev.get("online", []):
    tau[f"online {on['mode']}, {on['prompts']} held-out chitchat prompts"] = {
        "τ": round(on["mean_accepted_length"], 3), "τ/B": round(on["mean_accepted_length"] / off["block_size"], 3),
        "acceptance": " ".join(f"{a:.3f}" for a in on["acceptance_conditional"])}
    speed[f"{on['mode']}, {ev['dtype']}"] = {"plain tok/s": round(on["plain_tokens_per_s"], 1),
        "DSpark tok/s": round(on["dspark_tokens_per_s"], 1), "speed-up": f"{on['speedup']:.2f}×"}
card = build_model_card(
    DSparkConfig.from_pretrained(out), target="HuggingFaceTB/SmolLM2-135M-Instruct", repo_id="examples/smollm2-dspark",
    training_data=["SmolLM2-135M-Instruct's own greedy answers (dspark-hf regenerate) to the user turns of "
                   "chitchat-dataset 0.9.0 and chatterbot-corpus 1.3.3, train split only (hash split by conversation id)",
                   "calibrated (STS) and evaluated offline on the chitchat validation split; online on test-split prompts"],
    training_command=f"make drafter   # examples/make_drafter.sh, {steps} steps per drafter; the run that finished it took "
                     f"{seconds // 60} min (stages already done are skipped, so a resumed run reports less)",
    tau=tau, speed=speed, machine=f"{ev['machine']}; target and drafter in {ev['dtype']}",
    description="The default drafter of dspark-hf: a 1-layer DSpark drafter for SmolLM2-135M-Instruct trained on "
                "2 CPU cores. The checkpoint omits the frozen `embed_tokens`/`lm_head` (`bind_target_embeddings`); "
                "they are copied from the target on the first `generate`. Generation with it is lossless.")
card.save(out / "README.md")
print(f"model card -> {out / 'README.md'}")
EOF
stage "done: $OUT_DSPARK ($(du -sh "$OUT_DSPARK" | cut -f1)), $OUT_DFLASH ($(du -sh "$OUT_DFLASH" | cut -f1))"
