# docs/huggingface.md: a model preset from config.json (in a config directory of the user's), a run from the Hugging Face weights
# under tp=2, and the export back that transformers loads.
source "$REPO/docs/examples/hf_tiny.sh"
show "python -m launcher.convert model-config /tmp/tiny-llama > /tmp/my-conf/model/tiny_llama.yaml   # once, for a new model"
show cat /tmp/my-conf/model/tiny_llama.yaml
show python -m launcher.train --config-dir /tmp/my-conf model=tiny_llama parallel.tp=2 parallel.dp_shard=1 train.steps=20 \
    checkpoint.initial_load_path=/tmp/tiny-llama checkpoint.initial_load_format=hf \
    logging.wandb.mode=disabled hydra.run.dir=/tmp/tiny-run
show python -m launcher.convert to-hf /tmp/tiny-run /tmp/tiny-llama-trained --dtype bf16
show python -c "\"from transformers import AutoModelForCausalLM; m = AutoModelForCausalLM.from_pretrained('/tmp/tiny-llama-trained'); print(type(m).__name__, m.dtype)\""
