"""macfarm's Ray Serve app: OpenAI ingress, per-Mac replicas, prefix-affinity router."""
