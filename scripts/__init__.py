"""detjac's maintenance scripts (the default model's training, prompt corpora, screenshots, the GPU machine's
wheels): each Python module runs from the repository root as ``python -m scripts.NAME``; the shell scripts run as
``bash scripts/NAME.sh``. A script imports its own package, detjac's public modules and the support the benchmarks
keep (``benchmarks.support``: the real models' files), nothing else, and never edits ``sys.path``
(tests/test_benchmarks_and_scripts.py checks). ``mkdocs_hooks.py`` is loaded by mkdocs by its path
(mkdocs.yml) and imports only the standard library and mkdocs."""
