"""A training peer: the small contract between a plain PyTorch training loop and the swarm."""
