"""Training of what the repository ships: the LoRA adapters under adapters/ (`adapters`) and the
semantic hit guard's model (`guard`)."""
