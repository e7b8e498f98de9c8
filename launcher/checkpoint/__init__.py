"""Checkpoints: sharded DCP saves that are complete or invisible, resumable on any layout.

`store` works on the directories without torch (listing, checks, pruning); `saver` saves and
loads the trainer's state; `python -m launcher.checkpoint` lists and exports.
"""
