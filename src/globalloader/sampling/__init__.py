"""Index-space orders: epoch permutations, two-level sharding and the joint multi-job sampler."""
