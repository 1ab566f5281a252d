#!/usr/bin/env bash
# Set up (idempotent), then the main job: train the 2017 Transformer on the embedded
# English->German corpus, show held-out translations and the test BLEU, and draw the
# cross-attention alignment of one sentence.  Extra arguments go to `attnlab train translate`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OUT=${OUT:-runs/translate}
rm -rf "$OUT"
.venv/bin/attnlab train translate --out "$OUT" "$@"
.venv/bin/attnlab viz "$OUT" "when the old teacher sees forty-seven red birds , the girl helps the dog" \
    --out "$OUT/alignment.png"
echo "alignment plot: $OUT/alignment.png"
