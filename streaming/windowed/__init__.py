"""Windowed jobs' micro-batches: the event-time batch of a windowed job (stream or bounded)."""
