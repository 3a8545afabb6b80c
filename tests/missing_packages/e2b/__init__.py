"""Put first on ``PYTHONPATH`` to make ``import e2b`` fail as it does where the package is not installed.

The dev environment has E2B's SDK (tests/test_cloud_throttles.py drives it); the tests of what a user without it
sees run the command with this folder in front.
"""

raise ModuleNotFoundError("No module named 'e2b'", name="e2b")
