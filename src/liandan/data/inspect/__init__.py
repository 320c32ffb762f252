"""Statistics and anomaly flags of a corpus (inspection.py), its character classes (charclass.py), language
shares (language_share.py) and the rendered report (report.py). Imports steps/ and below."""
