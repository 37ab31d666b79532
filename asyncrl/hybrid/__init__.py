"""Training backends, generation engines and the train <-> generate switch (a later issue)."""
