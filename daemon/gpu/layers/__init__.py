"""The layers models are built from: attention backends, rotary, norms, tensor-parallel linear layers, fused ops, mixture of experts."""
