#!/usr/bin/env bash
# make_tokenizer.sh — regenerate assets/tokenizers/fortunes_2048.json, the
# tokenizer the debug recipes use: a 2048-token byte-level BPE (256 bytes +
# 1790 merges + <|begin_of_text|> + <|end_of_text|>) trained on every fortune
# text file of Debian's `fortunes` package. Training is deterministic: the
# same corpus gives the same file, byte for byte.
#
#   scripts/make_tokenizer.sh              # uses ./titan (builds if needed)
#   TITAN=build/titan scripts/make_tokenizer.sh
#
# FORTUNES_DIR overrides /usr/share/games/fortunes; OUT overrides the output.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TITAN="${TITAN:-$ROOT/titan}"
CORPUS="${FORTUNES_DIR:-/usr/share/games/fortunes}"
OUT="${OUT:-$ROOT/assets/tokenizers/fortunes_2048.json}"

# The fortune text files, sorted by name in the C locale; not the strfile
# indexes (*.dat) nor the *.u8 symlinks.
mapfile -t FILES < <(find "$CORPUS" -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' | LC_ALL=C sort)
if [ "${#FILES[@]}" -eq 0 ]; then
  echo "make_tokenizer: no fortune files in $CORPUS (apt-get install fortunes)" >&2
  exit 1
fi
mkdir -p "$(dirname "$OUT")"
# --force: regenerating the shipped file is the point (the CLI refuses to
# replace a tokenizer otherwise, since checkpoints depend on theirs).
exec "$TITAN" tokenizer train --vocab 2048 --force --out "$OUT" "${FILES[@]}"
