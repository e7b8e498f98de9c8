# docs/slurm.md: a sweep on the test cluster (tests/slurm/test_docs.py runs it there), one point
# rejected by the plan before anything is queued.
rm -rf /tmp/slurmdemo
show python -m launcher.train -m parallel.tp=1,2,3 hardware.devices_per_node=2 train.steps=20 \
    train.eval_interval=0 logging.wandb.mode=disabled hydra/launcher=slurm hydra.sweep.dir=/tmp/slurmdemo
