"""Corpus runs: every prompt of a file through the engine into one store, resumable.

``prompts`` reads prompts files and tokenizes them; ``batch`` computes one prompt into a
store; ``plan`` prepares a run (model, tokens, run description, store); ``local`` runs it in
one process and ``cluster`` on the workers of a dask.distributed cluster.
"""
