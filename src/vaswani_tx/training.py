"""Training wiring for ``Seq2SeqTrainer``.

:class:`TokenBudgetSeq2SeqTrainer` batches by tokens instead of sentences (Section 5.1: "each training
batch contained ... approximately 25000 source tokens and 25000 target tokens").
"""

from __future__ import annotations

from functools import partial

import datasets
from torch.utils.data import DataLoader
from transformers import Seq2SeqTrainer
from transformers.trainer_utils import seed_worker

from vaswani_tx.data import TokenBudgetBatchSampler


class TokenBudgetSeq2SeqTrainer(Seq2SeqTrainer):
    """A ``Seq2SeqTrainer`` whose batches hold at most ``max_tokens`` source and target tokens each.

    Training batches come from :class:`~vaswani_tx.data.TokenBudgetBatchSampler` (shuffled per epoch
    from ``args.data_seed`` or ``args.seed``, one disjoint equal share per process); evaluation
    batches, when ``eval_max_tokens`` is given, are length-sorted under that budget without shuffling,
    which wastes the least padding. ``per_device_*_batch_size`` is then unused. ``predict`` keeps
    the sentence-count batches so that its outputs stay in dataset order. Works with any seq2seq model
    whose dataset has ``input_ids`` and ``labels`` columns.

    Per-device budget: with ``P`` processes and ``G`` gradient-accumulation steps an optimizer step
    sees up to ``P * G * max_tokens`` tokens per side; the paper's 25,000 on 8 GPUs is about 3,125 each.
    """

    def __init__(self, *args, max_tokens: int, eval_max_tokens: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive number of tokens per batch, got {max_tokens!r}")
        self.max_tokens = max_tokens
        self.eval_max_tokens = eval_max_tokens

    def _token_budget_dataloader(self, dataset: datasets.Dataset, max_tokens: int, description: str, shuffle: bool) -> DataLoader:
        dataset = self._remove_unused_columns(dataset, description=description)
        sampler = TokenBudgetBatchSampler.from_dataset(
            dataset,
            max_tokens,
            shuffle=shuffle,
            seed=self.args.data_seed if self.args.data_seed is not None else self.args.seed,
            num_replicas=max(1, self.args.world_size),
            rank=self.args.process_index,
            # the budget must hold after the collator's own padding
            pad_to_multiple_of=getattr(self.data_collator, "pad_to_multiple_of", None),
        )
        dataloader = DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=self.data_collator,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
            persistent_workers=self.args.dataloader_persistent_workers,
            prefetch_factor=self.args.dataloader_prefetch_factor,
            worker_init_fn=partial(seed_worker, num_workers=self.args.dataloader_num_workers, rank=self.args.process_index),
        )
        dataloader = self.accelerator.prepare(dataloader)
        # The sampler already gives each process its share; accelerate's BatchSamplerShard would shard
        # it again, so make that wrapper a passthrough (as Trainer does for BatchRebalanceSampler).
        wrapper = getattr(dataloader, "batch_sampler", None)
        if wrapper is not None and getattr(wrapper, "batch_sampler", None) is sampler:
            wrapper.num_processes, wrapper.process_index = 1, 0
        return dataloader

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        return self._token_budget_dataloader(self.train_dataset, self.max_tokens, "Training", shuffle=True)

    def get_eval_dataloader(self, eval_dataset: str | datasets.Dataset | None = None) -> DataLoader:
        if self.eval_max_tokens is None:
            return super().get_eval_dataloader(eval_dataset)
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        return self._token_budget_dataloader(dataset, self.eval_max_tokens, "Evaluation", shuffle=False)
