"""Parameter-efficient fine-tuning: LoRA, DoRA, NF4 quantisation for QLoRA, PEFT-format adapters, and the
merge rules (linear, TIES, DARE) with adapters merged as peft merges them."""
