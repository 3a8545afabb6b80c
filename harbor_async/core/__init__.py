"""The foundation: the error hierarchy and the one failure table, limits and timeouts, logs, episode records and counters, the interrupt policy.

Imports: nothing of harbor_async.
"""
