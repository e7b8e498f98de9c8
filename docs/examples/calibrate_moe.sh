# docs/planner.md: a local sweep of an MoE model's micro-batch sizes with and without expert
# parallelism, then calibrate --from it.
rm -rf /tmp/moecal
show "python -m launcher.train -m model=mixtral_debug train.micro_batch_size=1,2,4 parallel.ep=1,2 hardware.devices_per_node=2 train.steps=20 train.eval_interval=0 logging.wandb.mode=disabled hydra.sweep.dir=/tmp/moecal > /dev/null"
show python -m launcher.plan.calibrate --from /tmp/moecal
