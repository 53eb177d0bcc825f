"""The network-free algorithm core: outer optimizer, delayed updates, DyLU, eager step, codecs."""
