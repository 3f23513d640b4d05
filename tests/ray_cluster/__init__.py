"""Ray tests: one local multi-node cluster for the folder (conftest.py)."""
