"""Pure loss functions of tensors, each with its paper's equation in the docstring."""
