"""The model side: the one classifier of a model server's failures, the managed model server (``vllm serve``), the models of an evaluation (checkpoints), the capture proxy that records an agent's model calls.

Imports: core.
"""
