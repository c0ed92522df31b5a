"""Pipeline stages, the pipelined train_step and the stages' gradients."""
