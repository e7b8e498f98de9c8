# docs/huggingface.md: a Hugging Face directory of another shape, refused before any process.
source "$REPO/docs/examples/hf_tiny.sh"
python -m launcher.convert model-config /tmp/tiny-llama > /tmp/my-conf/model/tiny_llama.yaml
show python -m launcher.train --config-dir /tmp/my-conf model=tiny_llama model.n_kv_heads=8 \
    checkpoint.initial_load_path=/tmp/tiny-llama checkpoint.initial_load_format=hf
