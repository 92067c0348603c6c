"""The replay buffer: samplers, storage backends, batch memory, and `TrajectoryReplayBuffer`."""
