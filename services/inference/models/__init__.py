"""Model families served by the engine (Llama, Mistral, Qwen2) and their loader."""
