# docs/huggingface.md's Hugging Face directory, made here (not shown): a random 4-layer Llama
# saved by transformers in four safetensors files with an index; and /tmp/my-conf, the config
# directory of the user's its model preset goes into (docs/config.md).
rm -rf /tmp/tiny-llama /tmp/tiny-run /tmp/tiny-llama-trained /tmp/my-conf
mkdir -p /tmp/my-conf/model
python - > /dev/null 2>&1 <<'PY'
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
config = LlamaConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=4, vocab_size=320,
                     max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False)
LlamaForCausalLM(config).save_pretrained("/tmp/tiny-llama", max_shard_size="1MB")
PY
