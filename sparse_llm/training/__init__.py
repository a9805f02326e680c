"""Training components: optimizer and schedule, checkpoints, metrics, callbacks, the train loop."""
