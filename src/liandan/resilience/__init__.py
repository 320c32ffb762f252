"""Resilience: the run supervisor (restarts after crashes and hangs), incidents and goodput."""
