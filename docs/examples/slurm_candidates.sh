# docs/slurm.md: the planner's three fastest layouts as a sweep on the test cluster.
rm -rf /tmp/slurmtopk
show python -m launcher.train -m '"plan.candidate=range(3)"' hardware.devices_per_node=2 train.steps=20 \
    train.eval_interval=0 logging.wandb.mode=disabled hydra/launcher=slurm hydra.sweep.dir=/tmp/slurmtopk
