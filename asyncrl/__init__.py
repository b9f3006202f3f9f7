"""asyncrl: fully-asynchronous off-policy RL for language models."""
