"""KV memory beyond the in-memory pool: the prefix cache's SSD tier."""
