"""Tokens in, batches out: token files and batching (batches.py), the training and validation
sources and their blend (sources.py); python_docs.txt.gz is the embedded corpus of the default
run. Writing token files from text is the `python -m launcher.prepare` command."""
