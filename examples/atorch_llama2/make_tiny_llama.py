"""What ATorch's Llama2 examples read from disk, tiny and offline (this file is ours, not ATorch's).

ATorch's ``dataset_model.sh`` downloads Llama-2 and wikitext; on a CPU with no network this writes
stand-ins in the same shapes, so the ported scripts run unchanged::

    python make_tiny_llama.py OUT [--block_size 32] [--blocks N]

* ``OUT/model``: a Hugging Face model folder (``AutoConfig`` / ``AutoTokenizer.from_pretrained``): a
  4-layer Llama config (hidden 64, 4 heads, 2 key/value heads: tensor 2 keeps whole heads) and a
  byte-level BPE tokenizer of 512 tokens trained on the text below;
* ``OUT/wikitext``: ``train.txt`` / ``validation.txt``, one line per row as wikitext's, from the
  documentation text CPython ships (``composable_atorch.data.text.corpus_text``), 1500 rows or (``--blocks N``)
  just enough for N blocks; example_utils reads it when the ``datasets`` package is not installed;
* ``OUT/ds_config.json``: ATorch's ``ds_3d_llama2_entry.sh`` config for a CPU: fp32 (DeepSpeed's fp16
  needs a GPU), 4 micro-batches of 2, and DeepSpeed's own ``WarmupLR`` holding the learning rate at
  3e-3 (the script hard-codes ATorch's 1e-5, too small to see a tiny model learn in a few steps).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

VOCAB = 512


def write_model(out: Path, block_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    from composable_atorch.data.text import corpus_text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus_text().splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        model_input_names=["input_ids", "attention_mask"],  # as Llama's tokenizer
    )
    fast.model_max_length = 1 << 30  # the scripts concatenate the rows before cutting blocks
    fast.save_pretrained(out)
    LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max(block_size, 64),
        bos_token_id=1,
        eos_token_id=2,
    ).save_pretrained(out)


def write_dataset(out: Path, rows: int = 1500, tokenizer_dir: Path | None = None, blocks: int = 0, block_size=32):
    """wikitext-style rows; with ``blocks``, just enough rows for that many blocks of ``block_size`` tokens
    (so that every step of a run sees the same batch: a loss that must fall, whatever the learning rate)."""
    from composable_atorch.data.text import corpus_text

    lines = [line for line in corpus_text().splitlines() if line.strip()]
    if blocks:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        total, rows = 0, 0
        while total < blocks * block_size:
            total += len(tok(lines[rows])["input_ids"])
            rows += 1
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.txt").write_text("\n".join(lines[:rows]) + "\n")
    (out / "validation.txt").write_text("\n".join(lines[rows : rows + 200]) + "\n")


def write_ds_config(path: Path, micro_batch: int = 2, accumulation: int = 4, lr: float = 3e-3) -> None:
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": accumulation,
        "steps_per_print": 50,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": lr, "warmup_max_lr": lr, "warmup_num_steps": 1}},
        "activation_checkpointing": {"partition_activations": False, "contiguous_memory_optimization": False},
        "wall_clock_breakdown": False,
        "pipeline": {"activation_checkpoint_interval": 1},
    }
    path.write_text(json.dumps(config, indent=2))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--block_size", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=0, help="train on this many blocks only (default: 1500 rows)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    write_model(args.out / "model", args.block_size)
    write_dataset(
        args.out / "wikitext", tokenizer_dir=args.out / "model", blocks=args.blocks, block_size=args.block_size
    )
    write_ds_config(args.out / "ds_config.json")
    print(f"tiny Llama, tokenizer, dataset and ds_config written to {args.out}")


if __name__ == "__main__":
    main()
