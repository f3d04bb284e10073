#!/usr/bin/env bash
# Tokenizing a corpus with a HuggingFace BPE tokenizer: `loom data prepare --tokenizer`
# (data/bpe_tokenizer.h, one thread) against tools/tokenize_hf.py (HuggingFace `tokenizers`, its
# Rust encoder), on the same files into the same shards — which are checked to be identical, bit
# for bit. Each of the six fixture tokenizers (tests/data/tokenizers: byte-level GPT-2, Llama 3,
# SmolLM and Qwen 2 (NFC) styles; sentencepiece-style Llama 2 and Metaspace; 600 tokens); the corpus is Tiny Shakespeare repeated COPIES times (a
# different file each, so no cache carries over between them). Best of RUNS runs each; MB/s of
# text in, end to end (reading, tokenizing, writing the shards). The peer at its best besides:
# `tokenizers` alone, its encode_batch over the files (Rust, every core), no shards written.
# Then one JSON Lines file of the same text, and one Parquet file (below). FILES_STYLES=" " skips
# the first table.
#   bench/tokenizer.sh     (needs a release build and `pip install tokenizers pyarrow`; LOOM=,
#                           COPIES=, RUNS=)
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
cat > "$WORK/hf_encode.py" <<'PY'
import json, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
texts = []  # each text file whole, each JSON line's "text"
for f in sys.argv[3:]:
    with open(f, encoding="utf-8") as lines:
        texts += [json.loads(l)["text"] for l in lines] if f.endswith(".jsonl") else [lines.read()]
best = None
for _ in range(int(sys.argv[2])):
    t0 = time.perf_counter()
    n = sum(len(e.ids) for e in tok.encode_batch(texts))
    t = time.perf_counter() - t0
    best = t if best is None or t < best else best
print(best)
PY
printf '%-8s %8s %14s %14s %10s %10s %12s %s\n' tokenizer "loom s" "tokenize_hf s" "encode_batch s" "loom MB/s" "hf MB/s" "batch MB/s" shards
for t in ${FILES_STYLES:-gpt2 llama3 smollm qwen2 llama2 metaspace}; do
  tok=tests/data/tokenizers/$t.json
  l=$(best "$LOOM" data prepare "${files[@]}" --tokenizer "$tok" --out "$WORK/loom_$t")
  h=$(best python3 tools/tokenize_hf.py --tokenizer "$tok" "${files[@]}" --out "$WORK/hf_$t")
  e=$(python3 "$WORK/hf_encode.py" "$tok" "$RUNS" "${files[@]}")
  same=$(diff -rq "$WORK/loom_$t" "$WORK/hf_$t" > /dev/null && echo "identical" || echo "DIFFER")
  python3 -c "print('%-8s %8.2f %14.2f %14.2f %10.1f %10.1f %12.1f %s' % ('$t', $l, $h, $e, $mb / $l, $mb / $h, $mb / $e, '$same'))"
done

# A JSON Lines corpus: Tiny Shakespeare's paragraphs COPIES times (each copy's numbered) as ONE
# file, a paragraph a line ({"text": ...}), plain and
# compressed (.jsonl.gz, .jsonl.zst); and the same paragraphs as a Parquet file's "text" column,
# as pyarrow writes it by default (SNAPPY, a dictionary that falls back to PLAIN pages: "pq") and
# with ZSTD ("zstd.pq"). One file used to be one thread; documents are now handed
# out a document a thread, so one file uses every core. Loom at 1 thread and at every core, its
# shards checked against tools/tokenize_hf.py's on the .jsonl.gz and the Parquet files; the peer
# besides: `tokenizers`' encode_batch over the paragraphs (every core, no reading or shards).
jmb=$(python3 - "$WORK/corpus.jsonl" "$CORPUS" "$COPIES" <<'PY'
import json, sys
text = open(sys.argv[2], encoding="utf-8", newline="").read()
size = 0
with open(sys.argv[1], "w", encoding="utf-8") as out:
    for i in range(1, int(sys.argv[3]) + 1):  # each copy's paragraphs a little different
        for para in text.split("\n\n"):
            doc = f"{i} {para}"
            size += len(doc.encode("utf-8"))
            out.write(json.dumps({"text": doc}) + "\n")
print("%.1f" % (size / 1e6))
PY
)
python3 - "$WORK/corpus.jsonl" <<'PY'
import json, sys
import pyarrow as pa, pyarrow.parquet as pq
with open(sys.argv[1], encoding="utf-8") as f:
    table = pa.table({"text": [json.loads(line)["text"] for line in f]})
pq.write_table(table, sys.argv[1].replace(".jsonl", ".parquet"))
pq.write_table(table, sys.argv[1].replace(".jsonl", ".zstd.parquet"), compression="zstd")
PY
gzip -k -6 "$WORK/corpus.jsonl"
zstd -q -3 -k "$WORK/corpus.jsonl"
docs=$(wc -l < "$WORK/corpus.jsonl")
echo
echo "# one JSON Lines file of $docs paragraphs ($jmb MB of text, $COPIES copies); loom at 1 and $(nproc) threads; MB/s of text"
printf '%-8s %-7s %10s %10s %12s %12s %s\n' tokenizer file "loom 1 s" "loom $(nproc) s" "loom MB/s" "batch MB/s" shards
for t in gpt2 llama2; do
  tok=tests/data/tokenizers/$t.json
  e=$(python3 "$WORK/hf_encode.py" "$tok" "$RUNS" "$WORK/corpus.jsonl")
  for f in jsonl jsonl.gz jsonl.zst parquet zstd.parquet; do
    one=$(best "$LOOM" data prepare "$WORK/corpus.$f" --tokenizer "$tok" --threads 1 --out "$WORK/j1_$t")
    all=$(best "$LOOM" data prepare "$WORK/corpus.$f" --tokenizer "$tok" --out "$WORK/jn_$t")
    same=$(diff -rq "$WORK/j1_$t" "$WORK/jn_$t" > /dev/null && echo "1 = $(nproc) threads" || echo "THREADS DIFFER")
    if [ "$f" != jsonl ] && [ "$f" != jsonl.zst ]; then
      rm -rf "$WORK/jh_$t"
      python3 tools/tokenize_hf.py --tokenizer "$tok" "$WORK/corpus.$f" --out "$WORK/jh_$t" > /dev/null
      same="$same, $(diff -rq "$WORK/jn_$t" "$WORK/jh_$t" > /dev/null && echo "= tokenize_hf" || echo "DIFFER from tokenize_hf")"
    fi
    python3 -c "print('%-8s %-7s %10.2f %10.2f %12.1f %12.1f %s' % ('$t', '$f'.replace('jsonl', 'j').replace('parquet', 'pq'), $one, $all, $jmb / $all, $jmb / $e, '$same'))"
  done
done
