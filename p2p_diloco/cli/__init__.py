"""Command-line entry points: run_peer, run_bootstrap and the demo."""
