#!/usr/bin/env bash
# The README's main command: train the Multi30k EN-DE recipe on CPU (under an hour on 2 idle cores, measured in
# docs/training.md), average its last 30 checkpoints (Section 6.1), score the averaged model on the whole val set
# with sacreBLEU (signature printed) and on val's held-out half, and translate a few sentences.
# The data: ../shared/data/multi30k-en-de ($VASWANI_SHARED_DATA/multi30k-en-de) when there, else `train` downloads
# Multi30k once from the Hugging Face Hub (bentrevett/multi30k) into runs/data/multi30k-en-de.
# Run it again after stopping it (Ctrl-C, or SIGINT / SIGTERM sent to this script: the running step stops too):
# training resumes from the last checkpoint instead of starting over.
# Extra arguments are key=value overrides of configs/train/multi30k-en-de.yaml (e.g. max_steps=200).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TOKENIZERS_PARALLELISM=false
CONFIG=configs/train/multi30k-en-de.yaml
RUN=runs/multi30k-en-de                      # output_dir of $CONFIG
# the folder `train` reads Multi30k from (vaswani_tx.data.multi30k: the local copy, else the Hub's download)
DATA=$(.venv/bin/python -c "from vaswani_tx.data.multi30k import multi30k_folder; print(multi30k_folder())")
# Offline (no request to the Hub) once the data are here; the first run of a clone without them downloads them.
if [ -d "$DATA" ]; then export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"; fi
VX=.venv/bin/vaswani-tx
# Each step through `forwarding`: an interrupt of this script (Ctrl-C, kill, a scheduler's SIGTERM) stops the step
# too, where bash alone would wait for it or leave it running.
source scripts/forward_signals.sh

forwarding $VX train "$CONFIG" --resume "$@"   # ends by averaging the last 30 checkpoints into $RUN/averaged
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
echo "== val (all $(wc -l < "$DATA/val.en") sentences), averaged model, its saved decoding settings:"
forwarding $VX evaluate "$RUN/averaged" --source "$DATA/val.en" --reference "$DATA/val.de" --output-dir "$RUN/averaged" \
    --force
# Val in two halves (docs/training.md): levers are chosen on the first (tuning) half, the second is reported.
HALF=$(( ($(wc -l < "$DATA/val.en") + 1) / 2 ))
for side in en de; do
    head -n "$HALF" "$DATA/val.$side" > "$RUN/val-tune.$side"
    tail -n +"$((HALF + 1))" "$DATA/val.$side" > "$RUN/val-held.$side"
done
echo "== val's held-out half (lines $((HALF + 1))-$(wc -l < "$DATA/val.en"), no choice made on it; lowercased beside cased):"
forwarding $VX evaluate "$RUN/averaged" --source "$RUN/val-held.en" --reference "$RUN/val-held.de" \
    --output-dir "$RUN/averaged" --name val-held --force
echo "== a few sentences:"
forwarding $VX translate "$RUN/averaged" "A man in a blue shirt is riding a bike down the street." \
    "Two dogs are playing in the snow." "A little girl is reading a book on a bench." \
    "A group of people are standing in front of a building."
echo "== training and dev curves: $RUN/curves.png"
