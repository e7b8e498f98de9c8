# docs/data.md: token files the plan refuses.
source "$REPO/docs/examples/own_data_files.sh"
python -m launcher.prepare --tokenizer tok/tokenizer.json --out data/docs docs.jsonl notes.txt > /dev/null
show python -m launcher.train data.path=data/docs.bin
show python -m launcher.prepare --out data/tiny tiny.txt
show python -m launcher.train data.path=data/tiny.bin
