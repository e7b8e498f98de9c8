# docs/running.md: text sampled from the wsd run of runs.sh (trained here first if it is not there).
[ -d /tmp/runsdemo/wsd/checkpoints/step_00000040 ] || python -m launcher.train train.steps=40 \
    train.lr_schedule=wsd logging.wandb.mode=disabled hydra.run.dir=/tmp/runsdemo/wsd > /dev/null
show python -m launcher.generate /tmp/runsdemo/wsd --prompt '"The list type"' --max-new-tokens 20 --temperature 0
