"""The one episode driver (begin, agent, verify once, stop: one record), judging, multi-step tasks, and the runner that drives a suite of episodes.

Imports: core, tasks, verification, backends, engine, jobs.
"""
