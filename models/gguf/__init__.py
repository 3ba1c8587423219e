"""GGUF checkpoints (llama.cpp's single-file format), read with the `gguf` package.

A GGUF file is turned once into an ordinary checkpoint folder (config.json,
dequantized safetensors, tokenizer files) in a cache keyed by the file's hash;
everything downstream (plan, checkpoint check, workers) then reads that folder
like any Hugging Face checkpoint:

    metadata.py   architecture + hyperparameters -> config.json body
    tensors.py    tensor types, dequantization, GGUF -> Hugging Face names
    cache.py      the cached folder: hash, atomic write, progress bar
"""
