#!/usr/bin/env bash
# Tokenizing a corpus with a HuggingFace byte-level BPE tokenizer: `loom data prepare
# --tokenizer` (data/bpe_tokenizer.h, one thread) against tools/tokenize_hf.py (HuggingFace
# `tokenizers`, its Rust encoder), on the same files into the same shards — which are checked to
# be identical, bit for bit. Each of the three fixture tokenizers (tests/data/tokenizers: GPT-2,
# Llama 3 and SmolLM styles, 600 tokens); the corpus is Tiny Shakespeare repeated COPIES times (a
# different file each, so no cache carries over between them). Best of RUNS runs each; MB/s of
# text in, end to end (reading, tokenizing, writing the shards).
#   bench/tokenizer.sh     (needs a release build and `pip install tokenizers`; LOOM=, COPIES=, RUNS=)
set -euo pipefail
cd "$(dirname "$0")/.."
LOOM=${LOOM:-./build/release/apps/loom}
COPIES=${COPIES:-8}
RUNS=${RUNS:-3}
CORPUS=${CORPUS:-../shared/data/tinyshakespeare.txt}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
python3 -c "import tokenizers" 2>/dev/null || { echo "bench/tokenizer.sh: pip install tokenizers" >&2; exit 2; }
files=()
for i in $(seq 1 "$COPIES"); do  # each copy a little different: its number on every line
  sed "s/^/$i /" "$CORPUS" > "$WORK/part_$i.txt"
  files+=("$WORK/part_$i.txt")
done
mb=$(du -cb "${files[@]}" | tail -1 | awk '{printf "%.1f", $1 / 1e6}')
echo "# cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs) x $(nproc); $mb MB of text" \
  "($COPIES files); tokenizers $(python3 -c 'import tokenizers; print(tokenizers.__version__)'); best of $RUNS"
best() {  # best wall seconds of RUNS runs of the command
  local b=""
  for _ in $(seq 1 "$RUNS"); do
    local t0 t1
    t0=$(date +%s.%N)
    "$@" > /dev/null 2>&1
    t1=$(date +%s.%N)
    b=$(python3 -c "t=$t1-$t0; b='$b'; print(t if b == '' or t < float(b) else b)")
  done
  echo "$b"
}
printf '%-8s %12s %12s %10s %10s %s\n' tokenizer "loom s" "tokenizers s" "loom MB/s" "hf MB/s" shards
for t in gpt2 llama3 smollm; do
  tok=tests/data/tokenizers/$t.json
  l=$(best "$LOOM" data prepare "${files[@]}" --tokenizer "$tok" --out "$WORK/loom_$t")
  h=$(best python3 tools/tokenize_hf.py --tokenizer "$tok" "${files[@]}" --out "$WORK/hf_$t")
  same=$(diff -rq "$WORK/loom_$t" "$WORK/hf_$t" > /dev/null && echo "identical" || echo "DIFFER")
  python3 -c "print('%-8s %12.2f %12.2f %10.1f %10.1f %s' % ('$t', $l, $h, $mb / $l, $mb / $h, '$same'))"
done
