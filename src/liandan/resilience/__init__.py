"""Resilience: surviving crashes, hangs and bad steps. Today: fault injection for testing recovery."""
