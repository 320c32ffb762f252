"""Exact and near dedup: MinHash signatures (minhash.py), the run (dedup.py), its global phase as band jobs
(dedup_bands.py) and its scoring against exact Jaccard (dedup_eval.py). Imports only documents/."""
