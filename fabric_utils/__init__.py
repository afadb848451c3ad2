"""The launcher (flags -> Fabric) and the small helpers train.py calls."""
