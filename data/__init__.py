"""Loading, tokenizing and batching text-classification data; the offline demo."""

PROBLEM_TYPES = ("single_label", "multi_label", "regression")  # here: task.py's flags name them before data loads
