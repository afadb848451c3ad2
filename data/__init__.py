"""Loading, tokenizing and batching text-classification data; the offline demo."""
