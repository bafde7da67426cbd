"""The ``vaswani_parseval`` metric module: ``evaluate.load`` its file, ``vaswani_parseval.py`` (see ``vaswani_tx.evaluation.load_metric``)."""
