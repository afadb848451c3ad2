"""Tokenize once, without padding, and cache the result with datasets' fingerprint cache."""

import bisect
import functools
import json
import math

import datasets
from datasets.fingerprint import Hasher
from transformers import DataCollatorWithPadding
from transformers import masking_utils
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask


def tokenize_splits(splits: datasets.DatasetDict, tokenizer, text_column: str, max_length: int,
                    text_pair_column: str | None = None, num_proc: int | None = None) -> datasets.DatasetDict:
    """Adds the tokenizer's model inputs and a ``length`` column (tokens per row); drops the text.

    With ``text_pair_column`` each row is a sentence pair, encoded the way the model was pretrained on pairs (BERT:
    ``[CLS] text [SEP] pair [SEP]``) and truncated longest text first; ``token_type_ids``, which text each token
    belongs to, are kept for the models whose tokenizer returns them (BERT, MiniLM; not DistilBERT).

    The cache key is the data's fingerprint plus the tokenizer's full definition, the columns and the length, so a
    second run with the same data, tokenizer, columns and ``max_length`` loads the cached result instead of
    tokenizing again.
    """
    definition = json.loads(tokenizer.backend_tokenizer.to_str())
    for state in ("truncation", "padding"):  # set by the call itself: would change the key after the first run
        definition.pop(state, None)
    tokenizer_id = Hasher.hash(definition)
    texts = [column for column in (text_column, text_pair_column) if column]
    keep = set(tokenizer.model_input_names)
    if not text_pair_column:
        keep.discard("token_type_ids")  # one text: all zeros, which is also what the model assumes without them

    def encode(batch):
        encoded = tokenizer(*(batch[column] for column in texts), truncation=True, max_length=max_length)
        out = {k: v for k, v in encoded.items() if k in keep}
        out["length"] = [len(ids) for ids in encoded["input_ids"]]
        return out

    return datasets.DatasetDict({
        name: split.map(encode, batched=True, remove_columns=texts, num_proc=num_proc, desc=f"tokenizing {name}",
                        new_fingerprint=Hasher.hash((split._fingerprint, tokenizer_id, texts, max_length,
                                                     sorted(keep))))
        for name, split in splits.items()
    })


# padded lengths grow by this factor from one bucket to the next (in steps of at least --pad-to-multiple-of): ~20
# shapes up to 512, the few graphs compiled and captured ones want, for ~7% padding on top of the real tokens of
# IMDB-length rows (length grouping keeps a batch's rows alike); a larger factor pads more, a smaller one adds shapes
BUCKET_GROWTH = 1.15


def length_buckets(max_length: int, multiple: int) -> list[int]:
    """The lengths batches are padded to: multiples of ``multiple`` growing by ``BUCKET_GROWTH``, then
    ``max_length``."""
    buckets, length = [], multiple
    while length < max_length:
        buckets.append(length)
        length = max(length + multiple, math.ceil(length * BUCKET_GROWTH / multiple) * multiple)
    return buckets + [max_length]


def make_collator(tokenizer, pad_to_max_length: bool, max_length: int, pad_to_multiple_of: int):
    """Pads each batch to the shortest bucket (``length_buckets``) that holds its longest row, or to ``max_length``.

    Whether a batch has padding is decided here, on the host: a batch without any loses its attention mask, so the
    model neither reads the mask back to check (a host-device sync per forward) nor passes it to attention, which
    may then take its fused (flash) kernel; a batch with padding keeps it, which transformers then applies unchecked
    (``apply_given_masks``).
    Batches come out as plain dicts: Fabric moves a dict's tensors one by one with ``non_blocking=True``, but calls a
    ``BatchEncoding``'s own ``.to(device)``, a blocking copy that waits for the GPU on every batch."""
    buckets = [max_length] if pad_to_max_length else length_buckets(max_length, pad_to_multiple_of)
    apply_given_masks()
    return functools.partial(_padded_dict, tokenizer, buckets)  # not a lambda: workers started by "spawn" pickle it


def _padded_dict(tokenizer, buckets, rows) -> dict:
    longest = max(len(row["input_ids"]) for row in rows)
    length = buckets[min(bisect.bisect_left(buckets, longest), len(buckets) - 1)]
    batch = dict(DataCollatorWithPadding(tokenizer, padding="max_length", max_length=length)(rows))
    if batch["attention_mask"].all():
        del batch["attention_mask"]
    return batch


def apply_given_masks() -> None:
    """Has transformers' SDPA and eager attention apply a given attention mask without first reading it back to see
    whether it masks anything (a host-device sync in every forward), as this module's batches carry a mask only where
    they have padding. Without a mask, transformers skips it as before (no read), for encoders and decoders; a
    decoder without a mask or cache (a classifier's) is not searched for packed rows either, a read of its position
    ids in every forward: this module pads each row apart, never packs two into one."""
    for name, make_mask in (("sdpa", sdpa_mask), ("eager", eager_mask)):
        ALL_MASK_ATTENTION_FUNCTIONS[name] = functools.partial(_given_mask_applied, make_mask)
    masking_utils.find_packed_sequence_indices = _never_packed


def _never_packed(position_ids):
    return None


def _given_mask_applied(make_mask, *args, attention_mask=None, **kwargs):
    if attention_mask is not None:
        kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    return make_mask(*args, attention_mask=attention_mask, **kwargs)
