"""The ``vaswani_bleu`` metric module: ``evaluate.load`` its file, ``vaswani_bleu.py`` (see ``vaswani_tx.metrics.evaluation.load_metric``)."""
