"""The training loop of a rank: its entry (engine.py: join, train, leave), the trainer
(trainer.py: build, step, evaluate, save, resume) and the optimizer with its schedule and
clipping (optim.py). Above everything else: it reads the plan, builds through parallel/, saves
through checkpoint/, and runs inside runtime/'s processes."""
