"""The ``vaswani_parseval`` metric module: ``evaluate.load`` its file, ``vaswani_parseval.py`` (see ``vaswani_tx.metrics.evaluation.load_metric``)."""
