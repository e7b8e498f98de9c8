"""`hydra/launcher=slurm` (conf/hydra/launcher/slurm.yaml): see slurm.py."""
