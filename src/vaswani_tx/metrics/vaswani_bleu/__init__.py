"""The ``vaswani_bleu`` metric module: ``evaluate.load`` its file, ``vaswani_bleu.py`` (see ``vaswani_tx.evaluation.load_metric``)."""
