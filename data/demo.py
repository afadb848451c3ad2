"""An offline stand-in for the real task: a synthetic sentiment dataset, a word-level tokenizer and a tiny random
BERT, written to disk so ``--demo`` goes through exactly the code path of ``--dataset PATH --model PATH``."""

import contextlib
import errno
import os
import random
import shutil
import tempfile
from pathlib import Path

import pandas as pd

POSITIVE = "good great wonderful superb brilliant moving delightful charming excellent memorable fun gripping".split()
NEGATIVE = "bad awful boring dull terrible weak clumsy tedious poor forgettable messy lifeless".split()
FILLER = ("the a film movie plot acting cast story director script scenes music ending was is and but with "
          "it this of to in for its very quite rather somewhat").split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
LABELS = ["negative", "positive"]


def make_review(rng: random.Random) -> tuple[str, str]:
    """A review whose label is the majority of its sentiment words; lengths vary widely, like real reviews."""
    label = rng.randrange(2)
    n_major = rng.randint(2, 6)
    n_minor = rng.randint(0, n_major - 1)
    major, minor = (POSITIVE, NEGATIVE) if label else (NEGATIVE, POSITIVE)
    words = [rng.choice(FILLER) for _ in range(rng.randint(5, 120))]
    words += [rng.choice(major) for _ in range(n_major)] + [rng.choice(minor) for _ in range(n_minor)]
    rng.shuffle(words)
    return " ".join(words), LABELS[label]


def write_demo_dataset(folder: Path, train_rows=4000, test_rows=1000, seed=0) -> Path:
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", train_rows), ("test", test_rows)):
        reviews = [make_review(rng) for _ in range(rows)]
        pd.DataFrame(reviews, columns=["text", "label"]).to_parquet(folder / f"{split}.parquet", index=False)
    return folder


def write_demo_model(folder: Path, seed=0) -> Path:
    """A word-level tokenizer over the demo vocabulary and a 2-layer, 64-wide BERT with random weights, the same on
    every node. Written by any process, whatever its rank: ``save_pretrained`` writes only on global rank 0 once a
    process group exists, which would leave the other nodes a folder without weights."""
    import torch
    from safetensors.torch import save_model
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + sorted(set(POSITIVE + NEGATIVE + FILLER)))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]",
                                        cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                        model_max_length=512)
    config = BertConfig(vocab_size=len(vocab), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=512, num_labels=len(LABELS),
                        pad_token_id=vocab["[PAD]"])
    with torch.random.fork_rng(devices=[]):  # the run's own random state stays as its seed made it
        torch.manual_seed(seed)
        model = BertForSequenceClassification(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.config.architectures = [type(model).__name__]  # as save_pretrained records it
    model.config.save_pretrained(folder)
    save_model(model, str(folder / "model.safetensors"))
    tokenizer.save_pretrained(folder)
    return folder


DATA_FILES = ("train.parquet", "test.parquet")
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def prepare_demo(root: Path) -> tuple[Path, Path]:
    """Writes the demo data and model under ``root`` once; returns (dataset folder, model folder)."""
    data, model = root / "data", root / "model"
    write_whole(data, write_demo_dataset, DATA_FILES)
    write_whole(model, write_demo_model, MODEL_FILES)
    return data, model


def write_whole(folder: Path, write, files: tuple) -> None:
    """Unless ``folder`` holds all of ``files``, runs ``write(tmp)`` on a fresh folder beside it and renames that into
    place, so nobody finds ``folder`` half-written: not a process that crashed midway, nor another node writing the
    same demo on a shared filesystem (rank 0 of every node prepares it). The rename is atomic; where a racer's
    complete folder landed first, ours is dropped, and an incomplete one is replaced."""
    def complete() -> bool:
        return all((folder / name).exists() for name in files)

    if complete():
        return
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    stale = tmp.with_name(f"{tmp.name}-stale")
    try:
        write(tmp)
        while True:
            try:
                os.replace(tmp, folder)
                return
            except OSError as err:
                if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
            if complete():  # a racer's complete folder landed first
                return
            shutil.rmtree(stale, ignore_errors=True)
            with contextlib.suppress(FileNotFoundError):  # an incomplete one goes aside, and ours takes its place
                os.replace(folder, stale)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(stale, ignore_errors=True)
