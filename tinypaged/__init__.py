"""tinypaged."""
