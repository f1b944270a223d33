"""Subcommands of the ``wavepp`` console script (each: add_arguments, run)."""
