"""One module per figure or table of the paper: ``python -m experiments.<name> [--full]``."""
