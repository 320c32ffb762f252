"""Tokens: tokenizers (tokenizer.py), token shards and stores (store.py), the local cache of stores named by URL
(cache.py), and for training the loader (loader.py, the one module of data that imports torch) and poisoned
copies of a store for the guard's tests (poison.py). Imports only documents/."""
