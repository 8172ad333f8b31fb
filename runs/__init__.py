"""Corpus runs: every prompt of a file through the engine into one store, resumable.

``prompts`` reads prompts files and tokenizes them; ``batch`` computes one prompt into a
store; ``plan`` prepares a run (model, tokens, run description, store); ``local`` runs it in
one process and ``cluster`` on the workers of a dask.distributed cluster; ``run`` is the whole
run from options to counts (``detjac run``). ``scheduler`` starts and stops the dask client
that distributed runs and the analyses use; ``steering`` steers a loaded model with a stored
concept prompt (``detjac steer``).
"""
