"""Data planes behind links: same-host shared memory (local)."""
