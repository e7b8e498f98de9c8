# docs/checkpoints.md: a run stopped with SIGTERM, the same command resuming it, the checkpoint
# table and an export. The kill lands in step 15 (LAUNCHER_FAULT_INJECT=0:15:stop sends it
# from there), so that the output is the same every time.
rm -rf /tmp/demo /tmp/exp.pt
A="train.steps=40 checkpoint.interval=10 logging.wandb.mode=disabled hydra.run.dir=/tmp/demo"
say "python -m launcher.train $A &"
say 'kill -TERM $!   # during step 15'
LAUNCHER_FAULT_INJECT=0:15:stop python -m launcher.train $A
show python -m launcher.train $A
show python -m launcher.checkpoint list /tmp/demo
show python -m launcher.checkpoint export /tmp/demo/checkpoints/step_00000040 /tmp/exp.pt
