# docs/checkpoints.md: the two newest checkpoints damaged (a shard cut short, a .metadata gone);
# the resume passes over them to the newest intact one.
rm -rf /tmp/ck1
A="checkpoint.interval=2 logging.wandb.mode=disabled hydra.run.dir=/tmp/ck1"
show "python -m launcher.train train.steps=8 $A > /dev/null"
truncate -s 1000 /tmp/ck1/checkpoints/step_00000008/__0_0.distcp
rm /tmp/ck1/checkpoints/step_00000006/.metadata
say "truncate -s 1000 /tmp/ck1/checkpoints/step_00000008/__0_0.distcp"
say "rm /tmp/ck1/checkpoints/step_00000006/.metadata"
show python -m launcher.train train.steps=10 $A
