"""What the host reads back from a sandbox, bounded: reward files, artifacts, transfers, per-episode and per-job disk bounds; the verifier run alone, and the sandbox a separate verifier runs in.

Imports: core.
"""
