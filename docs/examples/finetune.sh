# docs/finetune.md: a chat set prepared with a tokenizer's chat template, a fine-tune from a
# Hugging Face directory (recipe llama3_chat_debug), the export back with the tokenizer and its
# template, and a chat answer from the checkpoint.
# Made here, not shown: tok/, a 315-token BPE of the embedded corpus with Llama 3's special
# tokens and a Llama 3-style chat template in tokenizer_config.json; tiny-llama/, a random
# llama3_debug-shaped Llama saved by transformers; chat.jsonl, 400 conversations of the
# corpus's paragraphs (a question, an answer, some with a system turn or a second exchange).
python - > /dev/null 2>&1 <<'PY'
import gzip, json, os
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM
from launcher.data.batches import EMBEDDED

text = gzip.open(EMBEDDED).read().decode("utf-8", errors="replace")
paragraphs = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 40]
specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>"]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator(paragraphs[:2000], trainers.BpeTrainer(
    vocab_size=310, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
os.makedirs("tok")
tok.save("tok/tokenizer.json")
head = "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
template = ("{{ bos_token }}{% for message in messages %}{{ " + head + " + message['content'] | trim"
            " + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": template,
           "tokenizer_class": "PreTrainedTokenizerFast"}, open("tok/tokenizer_config.json", "w"))
torch.manual_seed(0)
config = LlamaConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=4, vocab_size=320,
                     max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False)
LlamaForCausalLM(config).save_pretrained("tiny-llama")
with open("chat.jsonl", "w") as f:
    f.write(json.dumps({"messages": [
        {"role": "system", "content": "Answer in one line."},
        {"role": "user", "content": "What does the with statement do?"},
        {"role": "assistant", "content": "It runs a block inside a context manager."}]}) + "\n")
    for i in range(399):
        a, b, c = (p[:n] for p, n in zip(paragraphs[3 * i : 3 * i + 3], (40, 30 + i % 7 * 15, 30)))
        turns = [{"role": "system", "content": "Answer briefly."}] if i % 3 == 0 else []
        turns += [{"role": "user", "content": a}, {"role": "assistant", "content": b}]
        if i % 4 == 1:
            turns += [{"role": "user", "content": "And then?"}, {"role": "assistant", "content": c}]
        f.write(json.dumps({"messages": turns}) + "\n")
PY
show head -n 1 chat.jsonl
show python -m launcher.prepare --chat --tokenizer tok/tokenizer.json --max-tokens 257 --long truncate --out chat/train chat.jsonl
FROM="data.path=chat/train.bin checkpoint.initial_load_path=tiny-llama checkpoint.initial_load_format=hf"
show python -m launcher.train recipe=llama3_chat_debug "$FROM" logging.wandb.mode=disabled hydra.run.dir=run
show python -m launcher.convert to-hf run exported
show ls exported
show python -m launcher.generate run --chat --prompt "'What does the with statement do?'" --temperature 0 --max-new-tokens 24
