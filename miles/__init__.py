"""miles: RL post-training whose lifecycle is an explicit state machine with one disposer."""
