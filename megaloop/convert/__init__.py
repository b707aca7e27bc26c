"""Conversion between megaloop checkpoints and Hugging Face folders.

``hf_import``: a local dense Llama / Mistral / Qwen2 / Qwen3 folder becomes a looped megaloop
checkpoint (the whole decoder is the core; "Closing the Loop" (arXiv 2610.00673) section 4's
dense-to-loop recipe); ``hf_families`` says which config.json fields it honours and refuses.
``hf_export``: a megaloop checkpoint becomes a Hugging Face folder served by the self-contained
modeling file in ``hf_modeling/``. ``layout`` holds the one name-and-shape mapping both directions
use; ``hf_folder`` checks a Hugging Face folder's files (config.json's types, its sizes against
the tensors and memory, finite weights) before either reader builds a model from them.
``tools/convert_checkpoint.py`` is the command line.
"""
