"""What `spikeckpt.wrapping.CheckpointedSequence` keeps of the model it wraps: the tensors a
call ran with (`call_tensors`), its state dict keys and what it remakes when the model
changes (`state_keys`), and the stack's unlisted-tensor error told with its layers
(`unlisted`)."""
