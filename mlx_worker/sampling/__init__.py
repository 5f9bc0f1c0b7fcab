"""From logits to text: sampling parameters and the in-graph sampler, grammars, incremental detokenization."""
