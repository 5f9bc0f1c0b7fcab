"""What runs in each step: continuous batching, the step budget and its measured cost, admission by deadline."""
