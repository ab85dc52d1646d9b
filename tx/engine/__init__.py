"""Request scheduling across tenants, futures and the durable store of the Tinker-compatible service."""
