"""Training speculum's own models: a small code model (the target) and drafts for it.

No weights can be downloaded, so the corpus is one every machine has: the ``.py`` files installed
with the running interpreter (:mod:`speculum.training.corpus`). :mod:`~speculum.training.data`
trains a byte-level BPE tokenizer on them and cuts token windows, :mod:`~speculum.training.loop`
is the one training loop (AdamW, warmup + cosine, held-out loss, resumable checkpoints) and
:mod:`~speculum.training.target` trains and saves a Llama target in Hugging Face format.
Submodules are imported on demand; importing this package loads nothing heavy.
"""
