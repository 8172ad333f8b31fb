"""detjac's benchmarks: each module of this folder is one benchmark, run from the repository root as
``python -m benchmarks.NAME`` (``--help`` says what it measures and how long it takes). What they share and the
library has no user for (the attribution methods compared with detjac's, the FLOP model, the GEMM replay, the
real-model findings' summaries, a results file several processes write, the shapes of real models, the real models'
files, the GPU check's steps) lives in :mod:`benchmarks.support`, which scripts may use too. A benchmark imports its
own package and detjac's public modules, nothing else, and never edits ``sys.path``
(tests/test_benchmarks_and_scripts.py checks)."""
