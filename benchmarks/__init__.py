"""Benchmarks of sandbox throughput, engine overhead and GRPO-step environment time.

Run them as ``harbor-async bench ...``; every figure is a ratio or a
distribution measured in one run on one machine (see ``machine.py``).
"""
