"""Integrations of WavePP with other serving engines; each imports only what its host engine's
environment has (no WavePP dependency beyond the standard library and ``wavepp.api``'s
standard-library modules)."""
