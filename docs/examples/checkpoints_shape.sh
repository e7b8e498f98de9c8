# docs/checkpoints.md: a checkpoint of another model shape is refused before any process starts.
rm -rf /tmp/shape /tmp/shape2
show "python -m launcher.train train.steps=2 checkpoint.interval=2 logging.wandb.mode=disabled hydra.run.dir=/tmp/shape > /dev/null"
show python -m launcher.train hydra.run.dir=/tmp/shape2 model.n_layers=2 \
    checkpoint.initial_load_path=/tmp/shape/checkpoints/step_00000002
