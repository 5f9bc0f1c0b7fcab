"""The engine's memory: the paged KV pool, page ownership and the prefix cache, recurrent state and its snapshots, the decode batch's staged KV, the activation budget."""
