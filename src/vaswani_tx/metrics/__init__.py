"""Evaluation metric modules shipped with the package, each loadable offline with ``evaluate.load(path)``."""
