"""Sampling: logits and SamplingMetadata in, tokens (and logprobs) out; the rejection sampler and the in-graph sampling tails. Knows nothing of the runner."""
