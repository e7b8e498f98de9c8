# docs/cluster.md: a site's hardware preset of its own, the self-test on one node of it, and the
# plan of the cut run with the preset the self-test fitted.
mkdir -p site/hardware
cat > site/hardware/mynode.yaml <<'YAML'
# Our machine: the cpu preset's figures, 2 ranks a node.
defaults:
  - cpu
  - _self_
name: mynode
devices_per_node: 2
YAML
show cat site/hardware/mynode.yaml
show python -m launcher.selftest --config-dir site hardware=mynode hydra.run.dir=selftest
show ls site/hardware
show python -m launcher.plan --config-dir site hardware=mynode_selftest
