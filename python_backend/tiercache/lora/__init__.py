"""LoRA adapters: the registry (name -> version), the residency tiers, and what they exchange."""
