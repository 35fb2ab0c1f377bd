"""Parameter-efficient fine-tuning: LoRA, DoRA, NF4 quantisation for QLoRA, PEFT-format adapters."""
