"""Documents, tokenizer, token shards and loaders."""
