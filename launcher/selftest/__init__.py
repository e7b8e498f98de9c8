"""`python -m launcher.selftest`: the engine's collectives proven on the user's own devices
against one process, the fabric timed against the planner's collective model, a hardware
preset fitted to both (docs/running.md, "Checking a cluster")."""
