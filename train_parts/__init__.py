"""The parts of train.py, a module per job (train.py's docstring lists them); none imports train.py."""
