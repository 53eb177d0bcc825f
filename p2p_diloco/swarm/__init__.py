"""The hivemind swarm layer: epochs in the DHT, fault-tolerant rounds, state download."""
