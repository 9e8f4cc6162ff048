"""Device backends: where cache memory lives and how it is copied."""
