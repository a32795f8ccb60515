"""Bounded twins: the identical transform over a bounded event-time range."""
