# docs/data.md's files, made in the current directory (not shown): tok/ (a 512-token byte-level
# BPE trained on the embedded corpus, with the tokenizer_config.json a model ships), docs.jsonl
# (the corpus's paragraphs, one per line: 2,608 of them), notes.txt (one document), bad.jsonl
# (a line without the text field), plain/ (a tokenizer with no EOS token) and tiny.txt.
python - > /dev/null 2>&1 <<'PY'
import gzip, json, pathlib
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from launcher.data.batches import EMBEDDED

paragraphs = [p for p in gzip.open(EMBEDDED).read().decode().split("\n\n") if p.strip()]
def bpe(specials):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(paragraphs[:2000], trainer)
    return tok
for name, specials in (("tok", ["<|begin_of_text|>", "<|end_of_text|>"]), ("plain", ["<pad>"])):
    pathlib.Path(name).mkdir()
    bpe(specials).save(f"{name}/tokenizer.json")
pathlib.Path("tok/tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end_of_text|>"}))
with open("docs.jsonl", "w") as f:
    for i, p in enumerate(paragraphs[:-1]):
        f.write(json.dumps({"id": i, "text": p}) + "\n")
pathlib.Path("notes.txt").write_text(paragraphs[-1])
pathlib.Path("bad.jsonl").write_text('{"text": "fine"}\n{"txt": "a typo"}\n')
pathlib.Path("tiny.txt").write_text("A file of thirty-three bytes.\n\n\n")
PY
