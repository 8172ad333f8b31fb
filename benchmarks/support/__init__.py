"""What several benchmarks share and no user of the library calls: the attribution methods detjac is compared with
(:mod:`.peers`), a sweep's FLOP model and the device's matmul rate (:mod:`.flops`), a sweep's GEMMs replayed alone
(:mod:`.gemm_share`), the real-model findings' summaries (:mod:`.findings`), a JSON results file that several
processes update at once (:mod:`.shared_json`), the shapes of real models (:mod:`.real_shapes`), the real trained
models' GGUF files installed as wheels (:mod:`.shipped`), and the GPU check's steps (:mod:`.gpu_run`,
:mod:`.gpu_steps`, :mod:`.gpu_graph`, :mod:`.gpu_tables`)."""
