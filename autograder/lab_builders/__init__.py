"""The lab notebooks are generated from these scripts, one per lab (`labNN.py`), so nobody edits
nbgrader metadata by hand. Edit a script, run `.venv/bin/python -m autograder.lab_builders.labNN`
from the repo root, and commit both; tests/test_lab_builders.py fails when they disagree."""
