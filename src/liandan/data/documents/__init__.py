"""The bottom room of data: `Document` and `DataError` (corpus.py), the readers of input files (readers.py,
storage.py for object storage) and the words of a text (text.py). It imports no other room."""
