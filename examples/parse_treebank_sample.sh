#!/usr/bin/env bash
# Section 6.3 on 2 CPU cores: train the parser-cpu preset on NLTK's free WSJ sample, parse a held-out
# part with the paper's decoding (beam 21, alpha 0.3, input + 300) constrained to trees, score it with
# EVALB's F1 (all sentences and <= 40 words), print the minutes it took; then, for comparison, the same
# model with the paper's plain beam search and the repair (--unconstrained).
# Usage: bash examples/parse_treebank_sample.sh [key=value ...] (overrides of configs/train/wsj-parse-cpu.yaml).
# A re-run resumes the training where it stopped.
# The sample's own held-out files (wsj_0180-0199) are not distributed here, so this holds out the
# last ten files it has: train wsj_0001-0159, dev wsj_0160-0169, test wsj_0170-0179.
set -euo pipefail
cd "$(dirname "$0")/.."
D=${TREEBANK:-../shared/data/treebank-sample/combined}
VASWANI_TX=${VASWANI_TX:-vaswani-tx}
OUT=runs/wsj-parse-cpu

$VASWANI_TX parse run configs/train/wsj-parse-cpu.yaml --resume "$@" \
    --train "$D/wsj_00*.mrg" "$D/wsj_01[0-5]?.mrg" --dev "$D/wsj_016?.mrg" --test "$D/wsj_017?.mrg"
echo "== $SECONDS s so far (uptime: $(uptime))"
MODEL=$OUT/averaged; [ -d "$MODEL" ] || MODEL=$OUT
echo "== the same model, unconstrained (the paper's plain beam search, repaired):"
$VASWANI_TX parse predict "$MODEL" --trees "$D/wsj_017?.mrg" --unconstrained -o $OUT/test.parsed.unconstrained --force
echo "== learning curve (dev F1 against training minutes): $OUT/curves.png"
