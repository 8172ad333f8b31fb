"""A detached decoder layer as explicit linear pieces (plain matmuls of recorded factors), and the layer runner
both engines share: the explicit sweeps of the in-memory and the streamed engine go through here."""
