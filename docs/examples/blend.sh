# docs/data.md: three sources prepared from Parquet and JSON lines (one of them two files,
# tokenized two at a time and cut into shards), mixed 0.6 / 0.3 / 0.1, trained with document
# masking and a named validation set (the last 200 documents, held out of the sources).
source "$REPO/docs/examples/own_data_files.sh"
python - > /dev/null <<'PY'
import json
import pyarrow as pa, pyarrow.parquet as pq
docs = [json.loads(line)["text"] for line in open("docs.jsonl")]
held, docs = docs[-200:], docs[:-200]
web, code, books = docs[0::3], docs[1::3], docs[2::3]
pq.write_table(pa.table({"url": [f"https://example.org/{i}" for i in range(len(web))], "text": web}), "web.parquet")
for name, part in (("code1", code[:400]), ("code2", code[400:]), ("books", books), ("held", held)):
    with open(f"{name}.jsonl", "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in part)
PY
T="--tokenizer tok/tokenizer.json"
show python -m launcher.prepare $T --out data/web web.parquet
show python -m launcher.prepare $T --workers 2 --shard-tokens 20000 --out data/code code1.jsonl code2.jsonl
show python -m launcher.prepare $T --out data/books books.jsonl
show python -m launcher.prepare $T --out data/held held.jsonl
show ls data/code
show python -m launcher.train model.vocab_size=512 data.attention=document \
    "'data.sources=[{path: data/web.bin, weight: 0.6}, {path: data/code, weight: 0.3}, {path: data/books.bin, weight: 0.1}]'" \
    "'data.val_sources={held: data/held.bin}'" train.steps=40 train.eval_interval=20 \
    logging.wandb.mode=disabled hydra.run.dir=run
