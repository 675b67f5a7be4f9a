"""Checkpoint layouts: our own (= the speculators/vLLM layout) and importers for z-lab DFlash and DeepSpec."""

from .convert import convert
from .export import export
from .speculators import read_speculators
from .toolkit import write_checkpoint

__all__ = ["convert", "export", "read_speculators", "write_checkpoint"]
