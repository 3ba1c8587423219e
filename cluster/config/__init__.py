"""What an operator writes and what it resolves to: the disagg YAML schema, the TensorRT-LLM
dialect, the default model, checkpoint checks and the startup plan (`auto` resolved once)."""
