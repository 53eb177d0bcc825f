"""Training data: the embedded corpus, local files and hub datasets, tokenized and sharded per peer."""
