# docs/planner.md: a local sweep of micro-batch sizes and two layouts, then calibrate --from it.
rm -rf /tmp/caldemo
show "python -m launcher.train -m train.micro_batch_size=1,2,4 parallel.tp=1,2 hardware.devices_per_node=2 train.steps=20 train.eval_interval=0 logging.wandb.mode=disabled hydra.sweep.dir=/tmp/caldemo > /dev/null"
show python -m launcher.plan.calibrate --from /tmp/caldemo
