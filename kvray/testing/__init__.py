"""The harness kvray's tests and benchmarks share (never imported by kvray itself).

- :mod:`.engines`: real vLLM engines on the CPU: a tiny random model written at run time,
  kvray's transfer config, engines in this process, in a fresh one or in a Ray actor.
- :mod:`.probe`: what a Ray cluster's processes spend (CPU by role, GCS RPCs, object bytes).
- :mod:`.cluster`: simulated multi-node Ray clusters, and joining a running Ray or starting one.
- :mod:`.pools`: waiting for a pool to settle, dropping a disk tier's files from the page cache.

Imported by module path (``from kvray.testing.engines import build_tiny_llama``), from the
tests, the scripts and the processes they start; no ``sys.path`` edits.
"""
