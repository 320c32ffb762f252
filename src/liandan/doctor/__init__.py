"""Doctor: checks that the machines and the training stack do what they should, before a run relies on them."""
