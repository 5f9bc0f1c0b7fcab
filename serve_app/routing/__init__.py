"""Which replica serves a request: the prefix-affinity router and the choice between replica groups."""
