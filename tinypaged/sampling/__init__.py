"""From logits to tokens: SamplingParams, the sampler, logits processors, structured output, prompt
logprobs, generation config."""
