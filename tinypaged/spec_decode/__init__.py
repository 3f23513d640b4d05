"""Speculative decoding: proposers guess k tokens per sequence, the target verifies them in one
forward (k + 1 positions per sequence through the varlen attention), the rejection sampler keeps
the longest acceptable prefix plus one token of the target's own (sampling/rejection_sampler.py),
and the block manager rolls back the KV slots of the rejected ones. See docs/speculative.md."""
