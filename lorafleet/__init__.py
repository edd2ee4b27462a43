"""lorafleet: multi-tenant LoRA serving."""
