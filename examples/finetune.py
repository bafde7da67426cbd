"""Fine-tune a saved vaswani_tx model on your own parallel files with Seq2SeqTrainer, evaluate, save.

    python examples/finetune.py MODEL_DIR --train-source train.de --train-target train.en \
        --dev-source val.de --dev-target val.en --target-lang en --output-dir finetuned --max-steps 300

MODEL_DIR is any folder `from_pretrained` reads (a trained or averaged run, a published model) with its
tokenizer. The recipe is the paper's (Section 5.3-5.4: Adam 0.9/0.98/1e-9, label smoothing 0.1) at a
fine-tuning learning rate; plain transformers pieces throughout, so each line is one a user could change.
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("--train-source", required=True)
    parser.add_argument("--train-target", required=True)
    parser.add_argument("--dev-source", required=True)
    parser.add_argument("--dev-target", required=True)
    parser.add_argument("--target-lang", required=True, help="target language code, for tokenized BLEU (e.g. en, de)")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--dev-pairs", type=int, default=200, help="dev pairs to translate at the end (0: all)")
    parser.add_argument("--num-beams", type=int, default=4)
    args = parser.parse_args(argv)

    from transformers import (
        AutoModelForSeq2SeqLM,
        AutoTokenizer,
        DataCollatorForSeq2Seq,
        Seq2SeqTrainer,
        Seq2SeqTrainingArguments,
    )

    import vaswani_tx
    from vaswani_tx.data.data import read_parallel_files, tokenize_pairs
    from vaswani_tx.data.tokenization import check_tokenizer_fits_model
    from vaswani_tx.metrics.evaluation import make_compute_metrics

    vaswani_tx.register_auto_classes()  # `import vaswani_tx` alone is light and registers nothing
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    check_tokenizer_fits_model(tokenizer, model.config)

    train = tokenize_pairs(read_parallel_files(args.train_source, args.train_target), tokenizer)
    dev = tokenize_pairs(read_parallel_files(args.dev_source, args.dev_target), tokenizer)
    if args.dev_pairs:
        dev = dev.select(range(min(args.dev_pairs, len(dev))))

    training_args = Seq2SeqTrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        adam_beta1=0.9,
        adam_beta2=0.98,
        adam_epsilon=1e-9,  # Section 5.3
        label_smoothing_factor=0.1,  # Section 5.4
        weight_decay=0.0,
        max_grad_norm=0.0,  # the paper clips nothing
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=min(100, args.max_steps // 10),
        predict_with_generate=True,
        generation_num_beams=args.num_beams,
        eval_strategy="no",
        save_strategy="no",
        logging_steps=max(1, args.max_steps // 10),
        report_to=[],
        use_cpu=True,
    )
    trainer = Seq2SeqTrainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=dev,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
        processing_class=tokenizer,
        compute_metrics=make_compute_metrics(tokenizer, target_lang=args.target_lang),
    )
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    trainer.save_model(args.output_dir)  # model, tokenizer, generation config and the remote-code files
    print(
        f"dev sacreBLEU before {before['eval_sacrebleu']:.2f} -> after {after['eval_sacrebleu']:.2f} "
        f"(dev loss {before['eval_loss']:.3f} -> {after['eval_loss']:.3f}); saved to {args.output_dir}"
    )
    return {"before": before, "after": after}


if __name__ == "__main__":
    main()
