"""Checkpoints: sharded, asynchronous, verified saves with exact resume, resharding and interchange."""
