"""The processes a run is made of and what they leave behind: torchrun's relaunch and signals
(launch.py), the rendezvous store of several nodes (rendezvous.py), the process group and its
meshes (distributed.py), stops, timeouts and injected faults (failures.py), the run directory
(rundir.py), progress and metrics (metrics.py), profiles (profiling.py). Below the trainer:
nothing here imports the planner, the engine's parallelism or the checkpoints."""
