"""A batch shaped as the model gets it, with no data read: for the flags that probe the model (FLOPs for MFU,
``--batch-size auto``, ``--compile``'s warm-up); imported only then."""

import torch


def make_example_batch(tokenizer, objective, rows: int, length: int, device) -> dict:
    """``rows`` copies of a row of ``length`` tokens as the tokenizer makes them, random words between its special
    tokens (T5 and BART check that each row ends in one end-of-text token), with the attention mask the model gets,
    and zero labels of the ``objective``'s kind, on ``device``. A generator of its own: the run's random numbers stay
    as its seed made them."""
    special = set(tokenizer.all_special_ids)
    words = [i for i in range(len(tokenizer)) if i not in special]
    drawn = torch.randint(len(words), (2 * length,), generator=torch.Generator().manual_seed(0)).tolist()
    row = tokenizer(tokenizer.decode([words[i] for i in drawn]), truncation=True, max_length=length)
    row = tokenizer.pad({name: row[name] for name in ("input_ids", "attention_mask")}, padding="max_length",
                        max_length=length, return_tensors="pt")
    labels = {"single_label": lambda: torch.zeros(rows, dtype=torch.long, device=device),
              "multi_label": lambda: torch.zeros(rows, objective.num_labels, device=device),
              "regression": lambda: torch.zeros(rows, device=device)}[objective.problem_type]()
    return {**{name: value.expand(rows, -1).to(device) for name, value in row.items()}, "labels": labels}
