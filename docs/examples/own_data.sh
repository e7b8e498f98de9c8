# docs/data.md: prepare with a Hugging Face tokenizer, the header, a short run on the result.
source "$REPO/docs/examples/own_data_files.sh"
show python -m launcher.prepare --tokenizer tok/tokenizer.json --out data/docs docs.jsonl notes.txt
show cat data/docs.json
show python -m launcher.train data.path=data/docs.bin model.vocab_size=512 hardware.devices_per_node=1 \
    train.steps=20 logging.wandb.mode=disabled hydra.run.dir=run
