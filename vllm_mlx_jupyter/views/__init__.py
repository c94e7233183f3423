"""What the notebook shows: a generation's live output, the token view, the cache inspector
and step timeline widgets, and a connected server's picture. Views read; they never drive the
engine."""
