"""Cleaning and filtering steps: the base classes (base.py) and liandan's own steps, plug-ins of kind
"data_step" listed in `liandan.plugins.BUILTIN`; wordlists/ holds the shipped bad-word lists. Imports dedup/
(decontamination hashes as near dedup does) and documents/."""
