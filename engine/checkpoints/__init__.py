"""Model sources: a checkpoint folder, a hub id, a GGUF file, quantized weights, the shipped default model and the
tiny random models of the tests, loaded into torch with errors a user can act on. What a MODEL argument names is
decided here (:mod:`.names`)."""
