"""Quantized safetensors checkpoints (AWQ, GPTQ, FP8) kept packed: schemes, formats, the layer\x27s weights."""
