"""What acts in an episode: the model's tool-calling loop, a harness driven by it, Harbor's own agents, and what a task needs of a backend and an agent (refused up front).

Imports: core, models, tasks, verification, backends, jobs, episodes, harnesses.
"""
