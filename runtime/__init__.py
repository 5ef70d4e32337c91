"""The CPU runtime: the compiled kernels (csrc/), their build and loading (native), the start-up probes and
their cache (timing_cache), the linear layers and weight loading both halves share, native memory settings."""
