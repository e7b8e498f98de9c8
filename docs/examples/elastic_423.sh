# docs/elastic.md: one command on 4 ranks, then 2, then 3. The stops land in steps 7 and 11
# (LAUNCHER_FAULT_INJECT=0:N:stop sends the SIGTERM from there), so that the output is the same
# every time.
rm -rf /tmp/elastic
A="train.steps=12 checkpoint.interval=2 parallel.auto=true logging.wandb.mode=disabled hydra.run.dir=/tmp/elastic"
say "A=\"$A\""
say 'python -m launcher.train $A hardware.devices_per_node=4      # SIGTERM during step 7'
LAUNCHER_FAULT_INJECT=0:7:stop python -m launcher.train $A hardware.devices_per_node=4
say 'python -m launcher.train $A hardware.devices_per_node=2      # SIGTERM during step 11'
LAUNCHER_FAULT_INJECT=0:11:stop python -m launcher.train $A hardware.devices_per_node=2
say 'python -m launcher.train $A hardware.devices_per_node=3'
python -m launcher.train $A hardware.devices_per_node=3
