"""lorafleet tests."""
