#!/usr/bin/env python3
"""Writes the Parquet fixtures of tests/data/parquet/ with pyarrow (checked with 26.0.1) and
fastparquet (2026.9.0): one list of texts written by two writers in the layouts a corpus meets —
every codec, data pages v1 and v2, dictionary, plain and delta encodings, a dictionary that
overflows into plain pages, page checksums, nulls, several row groups and small pages — and
expected.json: {"texts": [...], "files": {name: "texts" | "with_nulls" | "empty"}}, the texts
each file holds ("with_nulls": every 11th from the 4th a null). data/parquet_file.h must read them
back (tests/data/parquet_file_test.cc); they also seed tests/fuzz's fuzz_parquet.

    pip install pyarrow fastparquet
    python3 tools/make_parquet_fixtures.py tests/data/parquet

  snappy_dict_v1.parquet       SNAPPY, RLE_DICTIONARY, data pages v1, nulls; an int64 column before
                               the text, a struct column after it (a group: refused by name)
  gzip_plain_v2.parquet        GZIP, PLAIN, data pages v2, a large_string column, 3 row groups
  zstd_dict_v2.parquet         ZSTD, RLE_DICTIONARY, data pages v2, nulls
  none_delta_length.parquet    UNCOMPRESSED, DELTA_LENGTH_BYTE_ARRAY, a required column
  lz4_delta_byte_array.parquet LZ4_RAW, DELTA_BYTE_ARRAY, data pages v2
  brotli_fallback_crc.parquet  BROTLI, a dictionary that outgrows its limit (later pages PLAIN),
                               CRC-32 page checksums
  lz4_raw_dict_v1.parquet      LZ4_RAW, format 1.0 (PLAIN_DICTIONARY), data pages v1, nulls
  fastparquet_gzip.parquet     fastparquet's writer: GZIP, PLAIN, nulls
  fastparquet_lz4_block.parquet   codec LZ4 holding plain LZ4 blocks (as fastparquet writes it)
  fastparquet_lz4_hadoop.parquet  codec LZ4 in Hadoop's framing (as parquet-mr wrote it: each
                               page [big-endian size, compressed size, LZ4 block]; fastparquet's
                               compressor swapped for one that frames)
  empty.parquet                no rows

and fine-tuning examples in the Hub's layouts (`loom data prepare --sft`), with conversations.json:
{name: [row, ...]}, each row the JSON object of the columns the file holds:

  sft_messages.parquet         "messages": list<struct<content, role>> (HuggingFaceH4/ultrachat_200k's
                               layout) beside "prompt" and "id" columns; SNAPPY, pages v1
  sft_messages_zstd_v2.parquet the same rows but rows 4-7: a null list, an empty list, a null
                               content, a null element; ZSTD, data pages v2, 2 KB pages, row
                               groups of 30
  sft_sharegpt.parquet         sft_messages's conversations in ShareGPT's layout: "conversations":
                               list<struct<from, value>>, "human" / "gpt" / "system"
  sft_prompt_completion.parquet  TRL's prompt-completion: "prompt" and "completion" strings
  sft_prompt_completion_conversational.parquet  TRL's conversational prompt-completion:
                               "prompt" and "completion" lists of messages
"""
import json
import os
import random
import struct
import sys

import cramjam
import fastparquet
import fastparquet.compression
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq


def texts():
    rng = random.Random(20261206)
    words = ("the of and to in is was for on that with as by at from his her it be not this "
             "Loom trains one model on many devices café naïve Straße Ελληνικά русский 日本語 "
             "한국어 🙂 👍🏽 ∑ → ★").split()
    out = [
        "First Citizen:\nBefore we proceed any further, hear me speak.",
        "",
        "a NUL \x00 inside, tabs\tand\r\nwindows lines\n",
        "x" * 6000,  # longer than a page
        "emoji: 🙂👍🏽 and symbols ∑∫√ ← → ★",
    ]
    for i in range(240):
        n = rng.choice([0, 1, 3, 8, 20, 60, 120])
        out.append(" ".join(rng.choice(words) for _ in range(n)))
        if i % 7 == 0:
            out.append(out[rng.randrange(len(out))])  # repeats, for the dictionaries
    return out


def with_nulls(values):
    return [None if i % 11 == 3 else v for i, v in enumerate(values)]


def write_sft_fixtures(out_dir, texts):
    rng = random.Random(7)
    roles = ["user", "assistant"]
    rows = []
    for i in range(90):
        turns = rng.choice([2, 2, 4, 6])  # ending on an assistant turn
        messages = []
        if i % 5 == 0:
            messages.append({"content": "You are a helpful assistant.", "role": "system"})
        for k in range(turns):
            messages.append({"content": texts[rng.randrange(len(texts))][:60] or "ok",
                             "role": roles[k % 2]})
        rows.append({"id": i, "prompt": messages[0]["content"], "messages": messages})
    message = pa.struct([("content", pa.string()), ("role", pa.string())])
    schema = pa.schema([("id", pa.int64()), ("prompt", pa.string()), ("messages", pa.list_(message))])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema),
                   os.path.join(out_dir, "sft_messages.parquet"), compression="snappy",
                   data_page_version="1.0")
    sharegpt = [{"conversations": [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]),
                                     "value": m["content"]} for m in row["messages"]]}
                for row in rows]
    turn = pa.struct([("from", pa.string()), ("value", pa.string())])
    pq.write_table(pa.Table.from_pylist(sharegpt, schema=pa.schema([("conversations", pa.list_(turn))])),
                   os.path.join(out_dir, "sft_sharegpt.parquet"))
    rows = json.loads(json.dumps(rows))
    rows[3]["messages"] = None      # a null list
    rows[4]["messages"] = []        # an empty list
    rows[5]["messages"][1]["content"] = None  # a null string inside an element
    rows[6]["messages"] = [None, {"content": "hi", "role": "user"}]  # a null element
    pq.write_table(pa.Table.from_pylist(rows, schema=schema),
                   os.path.join(out_dir, "sft_messages_zstd_v2.parquet"), compression="zstd",
                   data_page_version="2.0", data_page_size=2048, row_group_size=30)
    pairs = [{"prompt": texts[i][:120], "completion": texts[i + 1][:120] or "yes"}
             for i in range(0, 120, 2)]
    pq.write_table(pa.Table.from_pylist(pairs, schema=pa.schema([("prompt", pa.string()),
                                                                 ("completion", pa.string())])),
                   os.path.join(out_dir, "sft_prompt_completion.parquet"))
    conversational = [{"prompt": [{"role": "user", "content": p["prompt"]}],
                       "completion": [{"role": "assistant", "content": p["completion"]}]}
                      for p in pairs]
    turn = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    pq.write_table(pa.Table.from_pylist(conversational, schema=pa.schema([("prompt", turn),
                                                                          ("completion", turn)])),
                   os.path.join(out_dir, "sft_prompt_completion_conversational.parquet"))
    expected = {}
    for name in ["sft_messages.parquet", "sft_messages_zstd_v2.parquet",
                 "sft_prompt_completion.parquet", "sft_prompt_completion_conversational.parquet"]:
        expected[name] = pq.read_table(os.path.join(out_dir, name)).to_pylist()
    with open(os.path.join(out_dir, "conversations.json"), "w", encoding="utf-8") as f:
        json.dump(expected, f, ensure_ascii=False, indent=0, sort_keys=True)
        f.write("\n")


def main():
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    plain = texts()
    nullable = with_nulls(plain)
    expected = {}

    def write(name, column, **options):
        pq.write_table(pa.table({"text": column}), os.path.join(out_dir, name), **options)
        values = column.to_pylist()
        expected[name] = ("empty" if not values else "texts" if values == plain else "with_nulls")

    # An int64 column first and a struct after: the text is not the first column.
    table = pa.table({
        "id": pa.array(range(len(nullable)), pa.int64()),
        "text": pa.array(nullable, pa.string()),
        "meta": pa.array([{"url": f"https://example.com/{i}", "score": i / 7}
                          for i in range(len(nullable))]),
    })
    pq.write_table(table, os.path.join(out_dir, "snappy_dict_v1.parquet"), compression="snappy",
                   use_dictionary=True, data_page_version="1.0", data_page_size=2048,
                   row_group_size=150)
    expected["snappy_dict_v1.parquet"] = "with_nulls"

    write("gzip_plain_v2.parquet", pa.array(plain, pa.large_string()), compression="gzip",
          use_dictionary=False, data_page_version="2.0", data_page_size=4096, row_group_size=160)
    write("zstd_dict_v2.parquet", pa.array(nullable, pa.string()), compression="zstd",
          use_dictionary=True, data_page_version="2.0", data_page_size=2048)
    schema = pa.schema([pa.field("text", pa.string(), nullable=False)])
    pq.write_table(pa.table({"text": pa.array(plain, pa.string())}, schema=schema),
                   os.path.join(out_dir, "none_delta_length.parquet"), compression="none",
                   use_dictionary=False, column_encoding={"text": "DELTA_LENGTH_BYTE_ARRAY"},
                   data_page_size=3000)
    expected["none_delta_length.parquet"] = "texts"
    write("lz4_delta_byte_array.parquet", pa.array(plain, pa.string()), compression="lz4",
          use_dictionary=False, column_encoding={"text": "DELTA_BYTE_ARRAY"},
          data_page_version="2.0", data_page_size=2500)
    write("brotli_fallback_crc.parquet", pa.array(nullable, pa.string()), compression="brotli",
          use_dictionary=True, dictionary_pagesize_limit=1024, write_page_checksum=True,
          data_page_size=2048)
    write("lz4_raw_dict_v1.parquet", pa.array(nullable, pa.string()), compression="lz4_raw",
          use_dictionary=True, version="1.0", data_page_version="1.0", data_page_size=4096)
    write("empty.parquet", pa.array([], pa.string()), compression="snappy")

    fastparquet.write(os.path.join(out_dir, "fastparquet_gzip.parquet"),
                      pd.DataFrame({"text": pd.Series(nullable, dtype=object)}),
                      compression="GZIP", row_group_offsets=200)
    expected["fastparquet_gzip.parquet"] = "with_nulls"
    fastparquet.write(os.path.join(out_dir, "fastparquet_lz4_block.parquet"),
                      pd.DataFrame({"text": pd.Series(plain, dtype=object)}), compression="LZ4")
    expected["fastparquet_lz4_block.parquet"] = "texts"

    def hadoop_lz4(data, **kwargs):
        block = bytes(cramjam.lz4.compress_block(data, store_size=False))
        return struct.pack(">II", len(data), len(block)) + block

    fastparquet.compression.compressions["LZ4"] = hadoop_lz4
    fastparquet.write(os.path.join(out_dir, "fastparquet_lz4_hadoop.parquet"),
                      pd.DataFrame({"text": pd.Series(nullable, dtype=object)}), compression="LZ4",
                      row_group_offsets=100)
    expected["fastparquet_lz4_hadoop.parquet"] = "with_nulls"

    write_sft_fixtures(out_dir, plain)

    with open(os.path.join(out_dir, "expected.json"), "w", encoding="utf-8") as f:
        json.dump({"texts": plain, "files": expected}, f, ensure_ascii=False, indent=0,
                  sort_keys=True)
        f.write("\n")
    for name in sorted(expected):
        meta = pq.ParquetFile(os.path.join(out_dir, name)).metadata
        column = [meta.schema.column(i).name for i in range(meta.num_columns)].index("text")
        codecs, encodings = set(), set()
        for g in range(meta.num_row_groups):
            c = meta.row_group(g).column(column)
            codecs.add(c.compression)
            encodings.update(c.encodings)
        print(f"{name}: {meta.num_rows} rows, {meta.num_row_groups} row groups, "
              f"{sorted(codecs)}, {sorted(encodings)}, {os.path.getsize(os.path.join(out_dir, name))} B")


if __name__ == "__main__":
    main()
