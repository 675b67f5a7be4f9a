#!/usr/bin/env bash
# `make corpus`: the on-policy corpus (SmolLM2's own answers to prompts of four domains), grown where it stopped and
# packed into the repository, so no later session pays for it again. Stage 1 of `make drafter`; runs alone as well.
#
#   unpack examples/smollm2-corpus (checked: its target is this SmolLM2, every gzip matches its manifest)
#   -> regenerate what SIZE asks beyond it (half the corpora greedy, half sampled at T = 0.8; train split, then the
#      validation conversations) -> pack everything back (deterministic gzips and manifest.json)
#
# Each file keeps its generation settings beside it (`regenerate` records them, `corpus pack` carries them into the
# manifest); a rerun with other settings is refused in one line, so a corpus never mixes two kinds of answer.
# Every step resumes: a killed run keeps the whole conversations it wrote, a rerun regenerates only the rest.
# Cost on 2 cores: SIZE=80 (7,632 conversations, about 913k assistant tokens) about 1.4 hours from nothing, 80 to 100
# (9,540 conversations, 1.13 M tokens: the committed corpus) 14 min more; a committed corpus costs a few seconds to
# unpack and check. Self-acceleration (`regenerate --drafter`) is not used: at the batch of 48 regeneration runs, the
# shipped drafter measured 243 tokens/s against plain 269 on one core of an Intel Xeon with AMX (bf16), so batched
# plain generation is the faster way to write a corpus here.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
CLI="$PY -m dspark_hf.cli"
WORK=${WORK:-build/smollm2-drafter}
CORPUS=${CORPUS:-examples/smollm2-corpus}  # the packed corpus in git ("" = none: regenerate into $WORK only)
SIZE=${SIZE:-100}                          # percent of each domain's prompts below (100, all: 9,540 conversations)
VALIDATION=${VALIDATION:-16}               # validation conversations per corpus (calibration and offline eval)
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$WORK/data"

if [ -n "$CORPUS" ] && [ -f "$CORPUS/manifest.json" ]; then
  $CLI corpus unpack --corpus "$CORPUS" --output "$WORK/data" --target smollm2
fi
regen() {  # corpus split limit max-turns temperature max-new-tokens
  local out="$WORK/data/$1-$2.jsonl"  # regenerate writes the split's conversations in order: N lines = the first N
  [ -f "$out" ] && [ "$(wc -l < "$out")" -ge "$3" ] && return
  $CLI regenerate --target smollm2 --dtype bfloat16 --batch-size 48 --input "$1" --split "$2" --limit "$3" \
    --max-turns "$4" --temperature "$5" --max-new-tokens "$6" --seed 0 --output "$out"
}
# Each domain is filled in passes (a quarter, a half, then all of its share), so a run stopped at any point leaves
# balanced data; a rerun skips the conversations already written. Two jobs side by side, one core each (logs in
# $WORK/regen-*.log), split by measured time: at SIZE=6 the six-turn chats take 186 s (42 tokens/s: long prompts
# re-encoded each turn, so small length groups), the code explanations 84 s, the other five corpora 55-91 s each.
share() { echo $(( ($1 * SIZE / 100 + $2 - 1) / $2 )); }  # $1 prompts at SIZE percent, pass 1/$2
regen_long_and_code() {
  for pass in 4 2 1; do
    regen chitchat-long train "$(share 240 $pass)" 6 0.8 128
    regen stdlib-explain train "$(share 1000 $pass)" 1 0 160
  done
}
regen_short() {
  for pass in 4 2 1; do
    regen chitchat train "$(share 1200 $pass)" 2 0 128
    regen wordnet-nouns train "$(share 2400 $pass)" 1 0 128
    regen chatterbot train "$(share 1900 $pass)" 1 0.8 128
    regen wordnet-verbs train "$(share 2000 $pass)" 1 0.8 128
    regen stdlib-write train "$(share 800 $pass)" 1 0.8 160
  done
}
regen_long_and_code > "$WORK/regen-long-and-code.log" 2>&1 &
long_job=$!
regen_short > "$WORK/regen-short.log" 2>&1 &
short_job=$!
wait "$long_job"  # set -e: a failed regeneration stops the script here
wait "$short_job"
for corpus in chitchat wordnet-nouns stdlib-explain chatterbot wordnet-verbs stdlib-write chitchat-long; do
  turns=1; [ "$corpus" = chitchat ] && turns=2; [ "$corpus" = chitchat-long ] && turns=6
  regen "$corpus" validation "$VALIDATION" "$turns" 0 128
done
if [ -n "$CORPUS" ]; then
  $CLI corpus pack --data "$WORK/data" --output "$CORPUS" --target smollm2
fi
