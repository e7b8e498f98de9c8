# docs/data.md: three sources (one of them two shards) prepared from JSON lines and text, mixed
# 0.6 / 0.3 / 0.1, trained with document masking and a named validation set (the last 200
# documents, held out of the sources).
source "$REPO/docs/examples/own_data_files.sh"
python - > /dev/null <<'PY'
import json
docs = [json.loads(line)["text"] for line in open("docs.jsonl")]
held, docs = docs[-200:], docs[:-200]
for name, part in (("web", docs[0::3]), ("code", docs[1::3]), ("books", docs[2::3]), ("held", held)):
    with open(f"{name}.jsonl", "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in part)
PY
head -n 400 code.jsonl > code1.jsonl && tail -n +401 code.jsonl > code2.jsonl
show python -m launcher.prepare --tokenizer tok/tokenizer.json --out data/web web.jsonl
show python -m launcher.prepare --tokenizer tok/tokenizer.json --out data/code/part1 code1.jsonl
show python -m launcher.prepare --tokenizer tok/tokenizer.json --out data/code/part2 code2.jsonl
show python -m launcher.prepare --tokenizer tok/tokenizer.json --out data/books books.jsonl
show python -m launcher.prepare --tokenizer tok/tokenizer.json --out data/held held.jsonl
show python -m launcher.train model.vocab_size=512 data.attention=document \
    "'data.sources=[{path: data/web.bin, weight: 0.6}, {path: data/code, weight: 0.3}, {path: data/books.bin, weight: 0.1}]'" \
    "'data.val_sources={held: data/held.bin}'" train.steps=40 train.eval_interval=20 \
    logging.wandb.mode=disabled hydra.run.dir=run
