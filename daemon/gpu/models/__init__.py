"""The decoder llmd runs (decoder.py), the architectures it runs as sets of that
decoder's features (architectures.py, by config.json's `architectures` name), and the
loaders that fill it from a Hugging Face directory or a GGUF file."""
