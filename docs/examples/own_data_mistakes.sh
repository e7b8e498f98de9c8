# docs/data.md: what prepare refuses.
source "$REPO/docs/examples/own_data_files.sh"
show python -m launcher.prepare --tokenizer tok/tokenizer.json --out data/bad bad.jsonl
show python -m launcher.prepare --tokenizer plain/tokenizer.json --out data/x notes.txt
show python -m launcher.prepare --tokenizer plain/tokenizer.json --eos '"</s>"' --out data/x notes.txt
