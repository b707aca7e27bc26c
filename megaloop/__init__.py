"""megaloop: train looped (recurrent-depth) language models on megatron-core.

Importing the package is light: it never imports Transformer Engine or apex. Entry points turn
on the CPU development mode (``megaloop.cpu_shim.enable()``) where CUDA is absent.
"""

__version__ = "0.1.0"
