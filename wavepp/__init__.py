"""WavePP: pipeline-parallel LLM prefill under prefix reuse, and its Kubernetes control plane."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("wavepp")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
    __version__ = "0.0.0"
